"""How to install an optional part of bagua: the distribution's name and the extra to ask for.

The import name is ``bagua``; the distribution is ``bagua-torch``, because the name ``bagua`` on
the package index belongs to the archived original (0.9, CUDA and Rust, torch <= 1.13).

Example::

    raise ImportError(f"RedisStore needs the redis client: {install_hint('redis')}")
"""

from __future__ import annotations

DISTRIBUTION = "bagua-torch"


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` (an extra of pyproject.toml), from the index and from a clone.

    Example::

        install_hint("lightning")   # "pip install 'bagua-torch[lightning]' (in a clone: pip install -e '.[lightning]')"
    """
    return f"pip install '{DISTRIBUTION}[{extra}]' (in a clone: pip install -e '.[{extra}]')"
