"""``sglang-gateway batch ...``: submit a JSONL file to a running gateway's batch API and watch it, with the ``openai``
SDK (what any client of the API would use): ``submit FILE --endpoint ... [--wait]``, ``status``, ``list``, ``cancel``,
``download``. The gateway's URL and key come from options or ``SGLANG_GATEWAY_URL`` / ``SGLANG_GATEWAY_KEY``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import openai
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.batches.shapes import ENDPOINTS, TERMINAL
from gateway.core.endpoints import CHAT_COMPLETIONS

batch_app = typer.Typer(help="Batch jobs on a running gateway (OpenAI's Files and Batches API).", no_args_is_help=True)
out = Console()
err = Console(stderr=True)

Url = Annotated[str, typer.Option("--url", envvar="SGLANG_GATEWAY_URL", help="The gateway's base URL.")]
Key = Annotated[str, typer.Option("--key", envvar="SGLANG_GATEWAY_KEY", help="A client key of the gateway (none: an open gateway).")]
BatchId = Annotated[str, typer.Argument(help="The batch id (batch_...).", show_default=False)]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=key or "none", max_retries=2, timeout=120)


def _call(work: Any) -> Any:
    """Run an SDK call; an API error becomes one line and exit code 1 (never a stack trace)."""
    try:
        return work()
    except openai.APIStatusError as error:
        body = error.body if isinstance(error.body, dict) else {}
        err.print(f"[bold red]error:[/] {error.status_code} {escape(str(body.get('message') or error.message))}", highlight=False)
    except openai.APIConnectionError as error:
        err.print(f"[bold red]error:[/] cannot reach the gateway: {escape(str(error))}", highlight=False)
    raise typer.Exit(1)


def _line(batch: Any) -> str:
    counts = batch.request_counts
    done = f"{counts.completed + counts.failed}/{counts.total}" if counts else "-"
    return f"{batch.id}  {batch.status:<11} {done:>11} lines  failed {counts.failed if counts else 0}  {batch.endpoint}"


@batch_app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="JSONL input: one request object per line (custom_id, method, url, body).", exists=True, dir_okay=False)],
    endpoint: Annotated[str, typer.Option(help=f"One of {', '.join(ENDPOINTS)}.")] = CHAT_COMPLETIONS,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress until the batch ends, then download its results.")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="With --wait: where the output file goes (default: FILE.output.jsonl).")] = None,
    url: Url = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """Upload FILE and create a batch of its lines (every line is checked first: a bad one is named, nothing created)."""
    if endpoint not in ENDPOINTS:
        raise typer.BadParameter(f"endpoint must be one of {', '.join(ENDPOINTS)}", param_hint="--endpoint")
    client = _client(url, key)
    with file.open("rb") as source:
        uploaded = _call(lambda: client.files.create(file=(file.name, source), purpose="batch"))
    batch = _call(lambda: client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"))  # type: ignore[arg-type]
    out.print(batch.id, highlight=False, markup=False)
    if wait:
        batch = _watch(client, batch.id)
        _save(client, batch, output or file.with_suffix(".output.jsonl"))
        if batch.status != "completed":
            raise typer.Exit(1)


def _watch(client: openai.OpenAI, batch_id: str) -> Any:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn())
    with Progress(*columns, console=err) as progress:
        task = progress.add_task(escape(batch_id), total=None, failed=0)
        while True:
            batch = _call(lambda: client.batches.retrieve(batch_id))
            counts = batch.request_counts
            progress.update(task, total=counts.total, completed=counts.completed + counts.failed, failed=counts.failed,
                            description=escape(f"{batch_id} {batch.status}"))  # fmt: skip
            if batch.status in TERMINAL:
                return batch
            time.sleep(poll_interval_s(progress.tasks[0].elapsed or 0.0))


def poll_interval_s(watched_s: float) -> float:
    """The pause between two status polls of ``--wait``: 1 s at first, then a tenth of how long it has watched, at
    most 30 s (a batch of hours is polled twice a minute, not 3,600 times an hour)."""
    return min(30.0, max(1.0, watched_s / 10))


def _save(client: openai.OpenAI, batch: Any, output: Path) -> None:
    for file_id, path in ((batch.output_file_id, output), (batch.error_file_id, output.with_suffix(".errors.jsonl"))):
        if file_id:
            path.write_bytes(_call(lambda file_id=file_id: client.files.content(file_id)).content)
            err.print(f"{path}", highlight=False, markup=False)


@batch_app.command()
def status(batch_id: BatchId, url: Url = "http://127.0.0.1:8000", key: Key = "") -> None:
    """One batch: status, lines done and failed, its files."""
    batch = _call(lambda: _client(url, key).batches.retrieve(batch_id))
    out.print(_line(batch), highlight=False, soft_wrap=True, markup=False)
    for name in ("input_file_id", "output_file_id", "error_file_id"):
        if getattr(batch, name):
            out.print(f"  {name}: {getattr(batch, name)}", highlight=False, markup=False)


@batch_app.command("list")
def list_batches(limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20, url: Url = "http://127.0.0.1:8000", key: Key = "") -> None:
    """The key's batches, newest first."""
    page = _call(lambda: _client(url, key).batches.list(limit=limit))
    for batch in page.data:  # one line each (greppable; ids never wrapped)
        out.print(_line(batch), highlight=False, soft_wrap=True, markup=False)


@batch_app.command()
def cancel(batch_id: BatchId, url: Url = "http://127.0.0.1:8000", key: Key = "") -> None:
    """Start no new line of the batch; lines in flight finish and their answers are kept."""
    out.print(_line(_call(lambda: _client(url, key).batches.cancel(batch_id))), highlight=False, markup=False)


@batch_app.command()
def download(
    batch_id: BatchId,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where the output file goes (errors: next to it, .errors.jsonl).")] = Path("output.jsonl"),
    url: Url = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """The batch's output (and error) file."""
    client = _client(url, key)
    batch = _call(lambda: client.batches.retrieve(batch_id))
    if not (batch.output_file_id or batch.error_file_id):
        err.print(f"[bold red]error:[/] batch {escape(batch_id)} has no result file yet ({escape(batch.status)})", highlight=False)
        raise typer.Exit(1)
    _save(client, batch, output)
