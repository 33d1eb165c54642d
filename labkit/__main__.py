"""`python -m labkit`: Ctrl-C at any moment, also while torch imports, ends with exit 130."""
import sys

if __name__ == "__main__":
    try:
        from .cli import main
        code = main()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        code = 130
    sys.exit(code)
