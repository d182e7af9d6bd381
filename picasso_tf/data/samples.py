"""Where the small real datasets shipped with the package live (bundled/README.md)."""
import os

BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundled")


def bundled_path(name):
    """The path of a bundled file, e.g. "criteo_sample.csv" or "ml-100k/ml-100k.inter"."""
    path = os.path.join(BUNDLED_DIR, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such bundled file; the package ships "
                                f"{sorted(os.listdir(BUNDLED_DIR))} (was it installed without its data?)")
    return path
