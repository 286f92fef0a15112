"""The docs build's griffe extension (docs/_ext/griffe_examples.py) reads ``#:`` comments.

geosharp documents many constants with Sphinx's ``#:`` comment above the assignment; griffe
itself reads only a string after it, so without the extension those constants were missing
from the API reference.
"""

import importlib.util
import pathlib
import textwrap

import pytest

griffe = pytest.importorskip("griffe")

EXT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_ext" / "griffe_examples.py"


def _load_ext():
    spec = importlib.util.spec_from_file_location("griffe_examples", EXT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doc_comments_become_attribute_docstrings(tmp_path):
    (tmp_path / "pkg_docext").mkdir()
    (tmp_path / "pkg_docext" / "__init__.py").write_text(
        textwrap.dedent(
            '''\
            # a plain comment, not documentation
            PLAIN = 1

            #: The first line of :data:`PLAIN`'s neighbour,
            #:
            #: and its second paragraph.
            DOCUMENTED = 2

            WITH_STRING = 3
            """Its own docstring wins."""

            #: Not this one.
            WITH_BOTH = 4
            """This one."""


            class Holder:
                #: A class attribute.
                x: int = 0
            '''
        )
    )
    ext = _load_ext()
    module = griffe.load(
        "pkg_docext",
        search_paths=[str(tmp_path)],
        extensions=griffe.load_extensions(ext.ExampleSections),
    )
    assert module["PLAIN"].docstring is None
    documented = module["DOCUMENTED"].docstring.value
    assert documented.startswith("The first line of <autoref")
    assert documented.endswith("neighbour,\n\nand its second paragraph.")
    assert module["WITH_STRING"].docstring.value == "Its own docstring wins."
    assert module["WITH_BOTH"].docstring.value == "This one."
    assert module["Holder"]["x"].docstring.value == "A class attribute."
