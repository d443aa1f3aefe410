"""Online: what a server (or one shard of a cluster) needs to start, from the files on disk.

    index folder (snapshot, serving folder or cluster state, each with online/) + checkpoint
        -> Retriever (model, online features, index) + DurableIndex + AdEncoder

`m31 index build` writes, beside the snapshot's files, the folder `online/`: the online
features (`Features.online`: vocabularies, the catalogue's per-ad features and text and
co-engagement embeddings, and the user store: each stored user's attributes and last L
engagements), which is everything the online path reads besides the checkpoint. A serving
folder or a cluster state made from the snapshot gets a copy of it. So a server needs no
dataset folder, never builds features and never writes into one.

The index must have been made by a model with the checkpoint's dimensions; a different
checkpoint hash is allowed (a retrained model of the same shape) but logged, since scores then
mix two models.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from m31.engine.ad_encoder import AdEncoder
from m31.engine.probe import Prober
from m31.engine.retriever import Retriever
from m31.engine.user_inputs import seed_users, users_of
from m31.features import Features
from m31.features.embedding_cache import embedding_cache_dir
from m31.features.folder import features_for
from m31.files import write_folder_atomic
from m31.index import DurableIndex
from m31.index.hierarchical import Clusters
from m31.model import checkpoint_hash, load_checkpoint
from m31.model.checkpoint import check_trained_on
from m31.users import UserStore
from m31.users.organic import OrganicEvents

log = logging.getLogger("m31.engine")

ONLINE = "online"  # the online features' folder in an index, serving or cluster state folder


@dataclass
class LoadedEngine:
    retriever: Retriever
    store: DurableIndex  # owns the serving folder's lock: close it
    encoder: AdEncoder

    def close(self) -> None:
        self.store.close()


def has_online(folder: Path) -> bool:
    return (Path(folder) / ONLINE / "meta.json").is_file()


def model_and_features(model: Path, data: Path, device: str = "cpu", users: bool = True) -> tuple:
    """(model, features): the checkpoint and the features it reads.

    `data`: a folder holding `online/` (an index snapshot, serving folder or cluster state:
    the online features, read as they are; `users=False`: without their per-user parts,
    `Features.load`), a features folder, or the dataset folder the model was trained on (its
    features for the checkpoint's split, built once into it: offline use).
    """
    net, blob = load_checkpoint(Path(model), device=device)
    data = Path(data)
    if has_online(data):
        feats = Features.load(data / ONLINE, users=users)
    else:
        feats = features_for(data, split=blob["split"]["name"])
    check_trained_on(blob, feats, Path(model))
    return net, feats


def online_users(folder: Path, keep=None) -> UserStore | None:
    """The user store the online features in `folder` seed (as `seed_users`, with the L they
    were written with), reading only the users, the catalogue's ids and the engagements; only
    the users whose ids `keep` selects (`UserStore.dump`), all without it. None if `folder`
    holds no online features (a cluster state made without them)."""
    import json

    import pyarrow.parquet as pq

    from m31.features.sequences import EventSequences

    if not has_online(folder):
        return None
    online = Path(folder) / ONLINE
    meta = json.loads((online / "meta.json").read_text())
    # Online features written before they recorded their L kept the config's.
    length = int(meta.get("max_len", meta["config"]["max_len"]))
    table = pq.read_table(online / "engagements.parquet")
    columns = {k: table[k].to_numpy() for k in table.column_names}
    user, ts = columns.pop("user"), columns.pop("ts")
    users = pq.read_table(online / "users.parquet")
    store = users_of(
        meta["vocab"],
        {k: users[k].to_numpy() for k in users.column_names},
        pq.read_table(online / "ads.parquet", columns=["ad_id"])["ad_id"].to_numpy(),
        EventSequences.from_events(user, ts, meta["n_users"], **columns),
        length,
    )
    return store if keep is None else store.owned(keep)


def online_organic(folder: Path, keep=None) -> OrganicEvents:
    """The organic events of the users the online features in `folder` hold (those whose ids
    `keep` selects, as in `online_users`), reading only the users' ids and the organic events;
    none if `folder` holds no online features."""
    import json

    import pyarrow.parquet as pq

    from m31.features.sequences import EventSequences

    if not has_online(folder):
        return OrganicEvents.empty(0)
    online = Path(folder) / ONLINE
    meta = json.loads((online / "meta.json").read_text())
    length = int(meta["config"]["organic_len"])
    table = pq.read_table(online / "organic.parquet", columns=["user", "ts", "topic"])
    user_ids = pq.read_table(online / "users.parquet", columns=["user_id"])["user_id"]
    user, ts, topic = (table[k].to_numpy() for k in ("user", "ts", "topic"))
    sequences = EventSequences.from_events(user, ts, meta["n_users"], topic=topic)
    events = OrganicEvents(user_ids.to_numpy(), sequences, length)
    return events if keep is None else events.owned(keep)


def write_online(folder: Path, feats: Features, max_len: int) -> None:
    """Write the online features of `feats` (each user's last `max_len` engagements) into
    `folder/online`, atomically."""
    online = feats if feats.is_online else feats.online(max_len)
    online.save(Path(folder) / ONLINE)


def require_online(source: Path) -> None:
    """Raise unless `source` holds online features."""
    if not has_online(source):
        raise FileNotFoundError(
            f"{Path(source) / ONLINE}: missing: this index was built before an index carried "
            "the features serving reads; build it again with `m31 index build`"
        )


def copy_online(source: Path, target: Path) -> None:
    """Give `target` (a serving folder or cluster state) the online features of `source` (the
    snapshot or state it was made from), unless it has them; atomically."""
    source, target = Path(source), Path(target)
    if has_online(target):
        return
    require_online(source)
    write_folder_atomic(
        target / ONLINE,
        lambda tmp: shutil.copytree(source / ONLINE, tmp, dirs_exist_ok=True),
        overwrite=True,  # an incomplete copy is never renamed into place: this is a leftover
    )


def serving_folder(index: Path, state: Path | None = None, device: str = "cpu", echo=None) -> Path:
    """The durable serving folder for `index`: itself when it is one, else one made once (at
    `state`, default INDEX.serving) from the snapshot `index`, with its online features."""
    index = Path(index)
    if DurableIndex.is_folder(index):
        return index
    if not (index / "manifest.json").is_file():
        raise ValueError(f"--index: {index} is neither an index snapshot nor a serving folder")
    state = Path(state) if state is not None else index.with_name(index.name + ".serving")
    if not DurableIndex.is_folder(state):
        require_online(index)  # before anything is made for an index without them
        if echo is not None:
            echo(f"initialising the serving state {state} from the snapshot {index}")
        DurableIndex.create(state, index, device=device).close()
    copy_online(index, state)  # also after a crash between the two
    return state


def load_engine(
    index: Path, model: Path, device: str = "cpu", probe: int | None = None
) -> LoadedEngine:
    """Open the serving folder `index` and the model that made it, ready to answer; with
    `probe`, each request scores that many clusters of the index's hierarchical index
    (`m31.engine.probe`) instead of every ad."""
    index = Path(index)
    if not has_online(index):
        raise FileNotFoundError(
            f"{index / ONLINE}: missing (a serving folder made from a snapshot gets its online "
            "features from it: start from the snapshot `m31 index build` wrote)"
        )
    prober = None
    if probe is not None:
        clusters = Clusters.load(index / ONLINE)
        if clusters is None:
            raise ValueError(
                f"--probe: {index / ONLINE} holds no clusters (build the index with "
                "`m31 index build --clusters C`)"
            )
        prober = Prober(clusters, probe)
    net, feats = model_and_features(model, index, device)
    # The user store: seeded from the online features, then the snapshot's and the log's events.
    users = seed_users(feats, net.cfg.max_len)
    store = DurableIndex.open(index, device=device, users=users)
    try:
        if store.index.dim_g != net.G or store.index.dim_x != net.D:
            raise ValueError(
                f"{index}: index vectors are G = {store.index.dim_g}, D = {store.index.dim_x}; "
                f"the model's are G = {net.G}, D = {net.D}"
            )
        if prober is not None and prober.clusters.centroids.shape[1] != net.G + net.D + 1:
            raise ValueError(
                f"--probe: {index / ONLINE}'s clusters are of other vectors than "
                f"the model's (G = {net.G}, D = {net.D}): build the index again"
            )
        digest, made_by = checkpoint_hash(model), store.index.model_hash
        if made_by is not None and made_by != digest:
            log.warning(
                "the index was made by checkpoint %s, not %s (%s): scores mix two models",
                made_by,
                digest,
                model,
            )
        retriever = Retriever(net, feats, store.index, users, probe=prober)
    except BaseException:
        store.close()
        raise
    return LoadedEngine(retriever, store, AdEncoder(net, feats, embedding_cache_dir()))
