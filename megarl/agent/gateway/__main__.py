"""``python -m megarl.agent.gateway``: a gateway over a Hugging Face model, to try an agent
against the policy without training.

    python -m megarl.agent.gateway --model /path/to/model --port 8000
    # OPENAI_BASE_URL=http://127.0.0.1:8000/sessions/try/v1 OPENAI_API_KEY=<printed key>

Serves the ``hf`` engine on CPU (or ``--device cuda``) in fp32; every session id in a base URL
is a session of its own. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.agent.gateway", description=__doc__)
    parser.add_argument("--model", default=None, help="an HF folder (default: SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="default: a random one, printed")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tool-format", default="hermes")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from megarl.agent.gateway import serve
    from megarl.engines.hf import HFEngine
    from megarl.models.hf_io import load_hf_model

    model, tokenizer = load_hf_model(args.model, device=args.device)
    engine = HFEngine(model, tokenizer, device=args.device)
    server = serve(
        engine,
        tokenizer,
        args.host,
        args.port,
        args.api_key,
        args.max_new_tokens,
        args.temperature,
        args.tool_format,
    )
    print(f"megarl gateway: {server.url}/sessions/<id>/v1  model {server.model_name}", flush=True)
    print(f"api key: {server.api_key}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
