"""`python -m bench.roofline`: bench/roofline/cli.py's main (bench/roofline/__init__.py's docstring says what it
models)."""

from bench.roofline.cli import main

if __name__ == "__main__":
    main()
