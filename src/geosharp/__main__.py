"""``python -m geosharp``: the ``geosharp`` command (``torchrun -m geosharp measure ...``)."""

from geosharp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
