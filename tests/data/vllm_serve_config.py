"""Stands in for ``vllm serve`` in tests (runs in an image with vLLM): vLLM's own ``serve`` argument
parser and engine config, but no server. Prints what vLLM made of the arguments as JSON; arguments
vLLM refuses exit 1 with vLLM's own message. Run as ``python3 vllm_serve_config.py MODEL [ARGS...]``,
where the entrypoint would run ``vllm serve MODEL [ARGS...]``."""

import json
import sys

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(["serve", *sys.argv[1:]])
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(args)
    compilation = engine_args.compilation_config
    sizes = compilation.get("cudagraph_capture_sizes") if isinstance(compilation, dict) else compilation.cudagraph_capture_sizes
    found = {"max_num_seqs": engine_args.max_num_seqs, "cudagraph_capture_sizes": sizes}
    try:
        config = engine_args.create_engine_config()
    except ValueError as exc:
        print(json.dumps({**found, "error": str(exc)}))
        sys.exit(1)
    print(json.dumps({**found, "max_model_len": config.model_config.max_model_len}))


if __name__ == "__main__":
    main()
