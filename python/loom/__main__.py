"""python3 -m loom run -m MODEL -p PROMPT [-n N] [--temp T] [--seed S] [--backend NAME]"""

import argparse
import sys

import loom


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m loom")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate text, as `loom run` does")
    run.add_argument("-m", "--model", required=True, help="a GGUF file or a Hugging Face folder")
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("-n", type=int, default=128, help="tokens to generate (default 128)")
    run.add_argument("--temp", type=float, default=None, help="temperature; 0 = greedy")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--backend", default=None, help="a backend by name (cpu, ref, cuda, ...)")
    run.add_argument("-c", type=int, default=0, help="context length")
    args = ap.parse_args(argv)
    try:
        with loom.Model(args.model, backend=args.backend, n_ctx=args.c) as m:
            for piece in m.generate(args.prompt, max_tokens=args.n, temperature=args.temp,
                                    seed=args.seed, stream=True):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except loom.Error as e:
        print(f"python3 -m loom run: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
