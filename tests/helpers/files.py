"""Files the tests write: a YAML config in a fresh temporary folder."""

import os
import tempfile


def yaml_file(text: str) -> str:
    """The path of a new ``config.yaml`` holding ``text``."""
    path = os.path.join(tempfile.mkdtemp(), "config.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path
