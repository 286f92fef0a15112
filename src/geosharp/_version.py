"""The version of geosharp (one place: the package, the store and the reports read it)."""

__version__ = "0.1.0.dev0"
