"""`agentspec-sim proxy --upstream URL -o trace.jsonl[.zst]`: record live agents' LLM calls into a trace."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from agentspec_sim.cli.errors import UsageError
from agentspec_sim.cli.root import app


@app.command()
def proxy(
    upstream: str = typer.Option(..., "--upstream", help="The OpenAI-compatible server to forward to (e.g. "
                                 "http://127.0.0.1:8000/v1).", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Trace to append to (.jsonl or .jsonl.zst; an existing "
                                "recording is continued).", show_default=False),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback unless told otherwise)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: any free port, printed)."),
    tokenizer: str = typer.Option("qwen3", "--tokenizer", help="Tokenizer named in the trace (for calls recorded "
                                  "as text)."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help="The served model's vocabulary, when larger "
                                          "than the tokenizer's (ids past the tokenizer can be emitted)."),
    ask_token_ids: bool = typer.Option(False, "--ask-token-ids", help="Ask the upstream for token ids "
                                       "(vLLM's return_token_ids), so calls are recorded exactly."),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="Upstream read timeout per request, seconds."),
    max_body_mb: float = typer.Option(64.0, "--max-body-mb", help="Largest request body accepted, MiB."),
    drain_s: float = typer.Option(30.0, "--drain-s", help="On Ctrl-C / SIGTERM, how long calls in flight may "
                                  "finish, seconds."),
) -> None:
    """Forward an agent's OpenAI-compatible calls to --upstream and append each completed chat or completion call
    to the trace as it finishes. Point the agent's base URL at the printed address; stop with Ctrl-C."""
    import importlib.util

    if not 0 <= port <= 65535:
        raise UsageError(f"--port: must be 0…65535, got {port}")
    for name, value in (("--timeout-s", timeout_s), ("--max-body-mb", max_body_mb), ("--drain-s", drain_s)):
        if not value > 0:
            raise UsageError(f"{name}: must be > 0, got {value}")
    if vocab_size is not None and vocab_size < 1:
        raise UsageError(f"--vocab-size: must be ≥ 1, got {vocab_size}")
    from agentspec_sim.capture.proxy import upstream_root

    try:
        upstream_root(upstream)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if importlib.util.find_spec("aiohttp") is None:
        raise UsageError("proxy needs aiohttp: pip install 'agentspec-sim[proxy]'")
    from agentspec_sim.capture.proxy import ProxyServer, RecordingProxy
    from agentspec_sim.capture.recorder import TraceRecorder
    from agentspec_sim.io.outputs import Output, check_outputs, sole_writer

    check_outputs(Output("--output", output, (".jsonl", ".jsonl.zst")), inputs={"--tokenizer": tokenizer})
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    with sole_writer(output, f"{output}.lock"):
        recorder = TraceRecorder(output, tokenizer=tokenizer, vocab_size=vocab_size)
        server = ProxyServer(
            RecordingProxy(upstream, recorder, timeout_s=timeout_s, max_body_bytes=int(max_body_mb * (1 << 20)),
                           ask_token_ids=ask_token_ids),
            host=host, port=port, drain_s=drain_s, handle_signals=True,
            # Agents may connect from this line on (before it: connection refused while the proxy starts).
            on_ready=lambda url: err.print(f"listening on {url}/v1 (recording proxy → {upstream}), appending to "
                                           f"{output}"
                                           + (f" ({recorder.stats.resumed_calls} calls there already)"
                                              if recorder.stats.resumed_calls else "")),
            on_tick=lambda s: err.print(f"{s.recorded['recorded']} calls recorded, "
                                        f"{sum(s.passed['upstream_errors'].values())} upstream errors"),
        )
        try:
            summary = server.run()
        except OSError as exc:
            if server.url is None:  # could not listen: the address is taken or not ours
                raise UsageError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            raise
    err.print(summary.line())
