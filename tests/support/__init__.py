"""What the tests share: fixtures' builders, clusters, references, clients."""
