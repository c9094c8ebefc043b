"""app layer of mlxppd (see docs/architecture.md): putting a node together.

The HTTP applications, the runtime behind them and the process's signals meet here, above
``http`` (which holds only handlers); the CLI hands off to it.
"""
