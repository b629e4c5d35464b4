"""Device meshes, logical-axis sharding rules and multi-host helpers (see :mod:`.mesh`, :mod:`.sharding`)."""
