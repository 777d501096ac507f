"""The device mesh, the logical-axis rules that shard every parameter and activation, and
multi-host start-up."""
