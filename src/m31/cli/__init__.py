"""The `m31` command line. Errors in input end with one line naming the file or field, exit 2.

The commands parse their options, call the library and print; each module holds a group:

    data.py      world generate|summary, data summary|movielens|import|validate, features build
    train.py     train (m31.training.job)
    evaluate.py  eval, simulate (m31.eval.runs), ablate (m31.eval.ablation)
    serve.py     demo, index build, cluster init|reshard, serve (m31.serve.launch), query, loadtest
    common.py    shared options, the error wrapper, NAME=PATH values

Nothing heavy is imported until a command runs (`m31 --help` loads neither PyTorch nor FastAPI).
"""

from __future__ import annotations

import typer

from m31.bench import cli as bench_cli
from m31.cli import data, evaluate, serve, train

app = typer.Typer(no_args_is_help=True, add_completion=False, help="m31: ads retrieval engine.")
world_app = typer.Typer(no_args_is_help=True, help="The synthetic ads marketplace.")
data_app = typer.Typer(no_args_is_help=True, help="Datasets: import and inspect.")
features_app = typer.Typer(no_args_is_help=True, help="Feature tables for training.")
index_app = typer.Typer(no_args_is_help=True, help="The ad index: build it from a trained model.")
cluster_app = typer.Typer(no_args_is_help=True, help="A sharded index on Ray: offline commands.")
app.add_typer(world_app, name="world")
app.add_typer(data_app, name="data")
app.add_typer(features_app, name="features")
app.add_typer(index_app, name="index")
app.add_typer(cluster_app, name="cluster")

world_app.command("generate")(data.world_generate)
world_app.command("summary")(data.summary)
data_app.command("summary")(data.summary)
data_app.command("movielens")(data.data_movielens)
data_app.command("import")(data.data_import)
data_app.command("validate")(data.data_validate)
features_app.command("build")(data.features_build)
app.command("train")(train.train_cmd)
app.command("eval")(evaluate.eval_cmd)
app.command("ablate")(evaluate.ablate_cmd)
app.command("simulate")(evaluate.simulate_cmd)
app.command("auction")(evaluate.auction_cmd)
app.command("demo")(serve.demo_cmd)
index_app.command("build")(serve.index_build)
cluster_app.command("init")(serve.cluster_init)
cluster_app.command("reshard")(serve.cluster_reshard)
app.command("serve")(serve.serve_cmd)
app.command("query")(serve.query_cmd)
app.command("loadtest")(serve.loadtest_cmd)
app.add_typer(bench_cli.app, name="bench")


def main() -> None:  # pragma: no cover - console entry point
    app()
