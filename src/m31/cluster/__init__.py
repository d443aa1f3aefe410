"""Scale-out on Ray (DESIGN §7): the ad index sharded over Ray actors, exact scatter-gather,
two-phase commits with one global version, and the HTTP API through Ray Serve.

layout.py       which shard owns an ad (splitmix64(ad_id) mod S), the state folder, and the
                offline commands `m31 cluster init` and `m31 cluster reshard` (no Ray)
records.py      the fsync'd record log of shards' transactions and the coordinator's decisions
shard.py        Shard: one shard's DurableIndex, its search and its side of the commit
coordinator.py  Coordinator: global versions, read points, the two-phase commit
actors.py       the shard and coordinator actors, how they are placed, and their start
cluster.py      Cluster: the ingress's handle of the actors: reads, mutations, status
read.py         Read: one scatter-gather at one read point, merged exactly
mutations.py    a mutation's part for each owning shard, committed through the coordinator
channel.py      a shard's searches from an ingress on its node, by socket, not Ray's call path
batches.py      the batcher's batches over the shards: each call answered as its shards answer
backend.py      ClusterBackend: the `m31.serve.backend.Backend` the HTTP routes drive
serve.py        `m31 serve --ray`: the HTTP API in this process or on Ray Serve replicas
reaper.py       kills what is left of a local Ray cluster once its server is gone

Needs the `ray` extra (`pip install m31[ray]`); nothing outside this package imports Ray.
"""
