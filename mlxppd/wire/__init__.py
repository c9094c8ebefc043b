"""wire layer of mlxppd (see docs/architecture.md): bytes on the network, never mlx.

Import from the modules (docs/protocol.md has the byte layouts):

* secret: ``secret`` (``load_cluster_secret``, ``ClusterSecret``, ``write_new_secret``)
* messages: ``codec`` (``Message``, ``MessageKind``, ``Tensor``), ``dtypes``, ``limits``
* transports: ``backends.create_transport(backend, WireConfig(...))`` -> ``transport.Transport``
  with ``listen(host, port, handler)`` and ``connect(host, port)`` -> ``channel.SecureChannel``
* errors: ``errors``; counters: ``stats.WireStats``; background tasks: ``tasks``
"""
