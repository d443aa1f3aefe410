import numpy as np
import pyarrow.compute as pc
import pytest

from m31.data import dataset
from m31.data.schema import TABLES
from m31.files import write_folder_atomic
from m31.vocabularies import FORMATS, GENDERS, PLATFORMS, SURFACES
from m31.world.config import PRESETS, preset
from m31.world.generate import COUNTRIES, generate
from m31.world.truth import GroundTruth

CFG = preset("tiny").with_overrides(n_impressions=12_000)


@pytest.fixture(scope="module")
def world():
    return generate(CFG, seed=7)


def test_same_seed_same_tables(world):
    again, truth = generate(CFG, seed=7)
    for name in TABLES:
        assert again.table(name).equals(world[0].table(name)), name
    for k, v in truth.to_arrays().items():
        np.testing.assert_array_equal(v, world[1].to_arrays()[k])


def test_other_seed_other_tables(world):
    other, _ = generate(CFG, seed=8)
    assert not other.events.equals(world[0].events)
    assert not other.ads.equals(world[0].ads)


def test_schemas_and_value_ranges(world):
    ds, truth = world
    for name, schema in TABLES.items():
        assert ds.table(name).schema.equals(schema), name
    assert ds.users.num_rows == CFG.n_users and ds.ads.num_rows == CFG.n_ads
    assert 0.9 * CFG.n_impressions < ds.events.num_rows <= CFG.n_impressions

    ev = ds.events
    ts = ev["ts"].to_numpy()
    assert (np.diff(ts) >= 0).all(), "events are sorted by time"
    t0, t1 = ds.meta["time_range"]
    assert ts.min() >= t0 and ts.max() < t1
    assert set(ev["surface"].to_pylist()) <= set(SURFACES)
    assert set(ev["platform"].to_pylist()) <= set(PLATFORMS)
    hour = ev["hour"].to_numpy()
    assert hour.min() >= 0 and hour.max() <= 23
    np.testing.assert_array_equal(hour, (ts % 86_400) // 3600)
    conv, click = ev["conversion"].to_numpy(), ev["click"].to_numpy()
    assert not (conv & ~click).any(), "a conversion follows a click"
    assert 0.01 < click.mean() < 0.3 and 0.01 < conv.sum() / click.sum() < 0.6

    ads = ds.ads
    assert set(ads["format"].to_pylist()) <= set(FORMATS)
    topics = ads["topic"].to_numpy()
    assert topics.min() >= 0 and topics.max() < len(ds.meta["topics"])
    assert all(t.strip() for t in ads["text"].to_pylist())
    for col, allowed in (
        ("target_countries", COUNTRIES),
        ("target_genders", GENDERS),
        ("target_platforms", PLATFORMS),
    ):
        assert set(pc.list_flatten(ads[col]).to_pylist()) <= set(allowed)
    assert truth.n_users == CFG.n_users and truth.n_ads == CFG.n_ads


def test_delivery_respects_creation_time_and_targeting(world):
    ds, _ = world
    users = ds.users.to_pylist()
    ads = ds.ads.to_pylist()
    for row in ds.events.slice(0, 2_000).to_pylist():
        ad, user = ads[row["ad_id"]], users[row["user_id"]]
        assert ad["created_at"] <= row["ts"]
        assert not ad["target_countries"] or user["country"] in ad["target_countries"]
        assert not ad["target_genders"] or user["gender"] in ad["target_genders"]
        assert not ad["target_platforms"] or row["platform"] in ad["target_platforms"]
        assert ad["target_age_min"] <= user["age"] <= ad["target_age_max"]


def test_new_ads_keep_arriving(world):
    ds, _ = world
    created = ds.ads["created_at"].to_numpy()
    t0, t1 = ds.meta["time_range"]
    assert 0.2 < ((created >= t0) & (created < t1)).mean() < 0.5


def test_best_ad_depends_on_context(world):
    _, truth = world
    users = np.arange(200)
    ts = truth.t0 + truth.span // 2
    best = np.stack(
        [
            truth.conversion_matrix(users, surface=s, hour=h, platform=0, ts=ts).argmax(1)
            for s in range(len(SURFACES))
            for h in (8, 20)
        ],
        axis=1,
    )  # [users, contexts]
    changes = np.mean([len(set(b)) > 1 for b in best])
    assert changes > 0.25, f"only {changes:.0%} of users have a context-dependent best ad"


def lowrank_residual(m: np.ndarray, rank: int) -> float:
    """Relative Frobenius residual of the best rank-`rank` fit (a `rank`-dim dot product)."""
    s = np.linalg.svd(m, compute_uv=False)
    return float(np.sqrt((s[rank:] ** 2).sum() / (s**2).sum()))


def test_lowrank_residual_is_zero_for_a_dot_product():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((300, 8)) @ rng.standard_normal((8, 500))
    assert lowrank_residual(m, 8) < 1e-6
    assert lowrank_residual(m, 1) > 0.5


def test_ground_truth_is_not_a_dot_product(world):
    _, truth = world
    p = truth.conversion_matrix(np.arange(300), surface=0, hour=12, platform=0, ts=truth.t0)
    # A rank-8 dot product leaves over half the matrix unexplained (measured: 0.87 and 0.65).
    assert lowrank_residual(p, 1) > 0.8
    assert lowrank_residual(p, 8) > 0.5


def test_facet_share_on_hand_made_interests():
    """Two facets along two axes, three ads near each; a match gain high enough that the soft max
    over facets is a max. The ads, in the order of their best match: 1.0 (facet 0), 0.95 (facet
    1), 0.9 (0), 0.85 (1), 0.8 (0), 0.75 (1)."""
    angle = np.arccos([1.0, 0.9, 0.8])
    angle = np.concatenate([angle, np.arcsin([0.95, 0.85, 0.75])])
    ad_vec = np.stack([np.cos(angle), np.sin(angle)], 1).astype(np.float32)
    truth = GroundTruth(
        facet_vec=np.float32([[[1, 0], [0, 1], [0, 0]]] * 3),
        facet_w0=np.float32([[3.0, -3.0, -1e4], [0.01, 0.0, -1e4], [0.0, -10.0, -1e4]]),
        facet_drift=np.float32([[0, 0, 0], [0, 0, 0], [0, 20.0, 0]]),
        facet_topic=np.int32([[0, 1, -1], [0, 1, -1], [0, 1, -1]]),
        ad_vec=ad_vec, ad_quality=np.zeros(6, np.float32), ad_format=np.zeros(6, np.int64),
        ad_category=np.zeros(6, np.int64), ad_objective=np.zeros(6, np.int64),
        surface_format=np.zeros((1, 3), np.float32), hour_category=np.zeros((24, 1), np.float32),
        platform_objective=np.zeros((1, 3), np.float32), topic_vec=np.eye(2, dtype=np.float32),
        t0=0, span=100, beta=4.0, kappa=20.0,
    )  # fmt: skip
    users, start = np.array([0, 1]), np.array([0, 0])
    # user 0: facet 0 outweighs every match, its three ads come first; user 1: both weigh alike,
    # the top 3 alternate (1.0, 0.95, 0.9)
    np.testing.assert_allclose(truth.facet_share(users, start, 3), [0.0, 1 / 3])
    # all six: for user 0, facet 0 (+3) also wins the last ad (cos 0.66: 16.2 against 12)
    np.testing.assert_allclose(truth.facet_share(users, start, 6), [1 / 3, 0.5])
    # user 2's facet 1 drifts from -10 to +10: the heaviest facet, and its top 3, change sides
    # (the padded third facet, weight -1e4, never wins)
    for t in (0, 100):
        np.testing.assert_allclose(truth.facet_share(np.array([2]), np.array([t]), 3), [0.0])
    with pytest.raises(ValueError, match="k must be in"):
        truth.facet_share(users, start, 7)
    with pytest.raises(ValueError, match="2 users but 1 times"):
        truth.facet_share(users, np.array([100]), 3)


def test_facet_weight_scale(world):
    """Scale 1 is the default world draw for draw; scale 0 weighs every facet alike, and then
    the best ads of a user mix facets far more."""
    ds, truth = world
    same, same_truth = generate(CFG.with_overrides(facet_weight_scale=1.0), seed=7)
    np.testing.assert_array_equal(same_truth.facet_w0, truth.facet_w0)
    assert same.events.equals(ds.events)
    flat_ds, flat = generate(CFG.with_overrides(facet_weight_scale=0.0), seed=7)
    valid = truth.facet_topic >= 0
    np.testing.assert_array_equal(flat.facet_vec, truth.facet_vec)
    assert (flat.facet_w0[valid] == 0).all() and (flat.facet_drift == 0).all()
    assert (flat.facet_w0[~valid] == truth.facet_w0[~valid]).all()  # padding stays padding
    assert flat_ds.ads.equals(ds.ads)
    users = np.arange(200)
    ts = np.full(200, truth.t0 + truth.span)
    assert flat.facet_share(users, ts, 20).mean() > 2 * truth.facet_share(users, ts, 20).mean()
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="facet_weight_scale"):
            CFG.with_overrides(facet_weight_scale=bad)


def test_world_config_from_a_meta_file():
    d = CFG.to_dict()
    assert type(CFG).from_dict(d) == CFG
    del d["facet_weight_scale"]  # written before the setting existed
    assert type(CFG).from_dict(d) == CFG
    with pytest.raises(ValueError, match="unknown world settings"):
        type(CFG).from_dict({**d, "gravity": 9.8})


def test_truth_round_trips_through_arrays(world):
    _, truth = world
    again = GroundTruth.from_arrays(truth.to_arrays())
    u = np.arange(5)
    a = np.arange(10)
    np.testing.assert_array_equal(
        again.conversion_matrix(u, 1, 3, 2, truth.t0, ads=a),
        truth.conversion_matrix(u, 1, 3, 2, truth.t0, ads=a),
    )


def test_save_load_round_trip(world, tmp_path):
    ds, truth = world
    out = dataset.save(ds, tmp_path / "w", extra=truth.to_arrays())
    again = dataset.load(out)
    for name in TABLES:
        assert again.table(name).equals(ds.table(name)), name
    assert again.meta == ds.meta
    np.testing.assert_array_equal(dataset.load_truth(out)["ad_vec"], truth.ad_vec)


def test_interrupted_save_leaves_nothing(tmp_path):
    def fill(tmp):
        (tmp / "users.parquet").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder_atomic(tmp_path / "w", fill)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_folder(world, tmp_path):
    ds, _ = world
    out = dataset.save(ds, tmp_path / "w")

    def fill(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_folder_atomic(out, fill, overwrite=True)
    assert dataset.load(out).events.equals(ds.events)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_presets_and_bad_config():
    assert set(PRESETS) == {"tiny", "demo", "bench"}
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ValueError, match="n_ads must be positive"):
        CFG.with_overrides(n_ads=0)


def test_ads_publish_a_quality_estimate_not_the_truth(world):
    """Models read the ads table: its quality column must not be the ground truth's quality."""
    ds, truth = world
    published = ds.ads["quality"].to_numpy()
    corr = np.corrcoef(published, truth.ad_quality)[0, 1]
    assert not np.allclose(published, truth.ad_quality)
    assert 0.55 < corr < 0.85  # 1 / sqrt(2) at the default noise
    exact, _ = generate(CFG.with_overrides(quality_noise=0.0), seed=7)
    np.testing.assert_array_equal(exact.ads["quality"].to_numpy(), truth.ad_quality)
    assert exact.events.equals(ds.events), "the estimate's noise draws from its own stream"
    with pytest.raises(ValueError, match="quality_noise"):
        CFG.with_overrides(quality_noise=float("nan"))
