import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers such as hf_models

from halo import BUNDLED_MODEL  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session", autouse=True)
def device_cache(tmp_path_factory):
    """Device benchmarks (and head-importance profiles) and model digests go to temporary directories, inherited by the
    agents tests start: tests never write into, or prune, the user's ~/.cache/halo."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HALO_DEVICE_CACHE_DIR", str(tmp_path_factory.mktemp("devices")))
        patch.setenv("HALO_FINGERPRINT_CACHE_DIR", str(tmp_path_factory.mktemp("fingerprints")))
        yield


@pytest.fixture(scope="session")
def known_answer() -> str:
    """The greedy text from ../shared/models/stories260K/README.md (bundled copy in halo/assets)."""
    readme = Path(str(BUNDLED_MODEL)).parent / "README.md"
    text = readme.read_text()
    block = text.split("## Known answer", 1)[1].split("```", 2)[1]
    return block.strip("\n")


@pytest.fixture(scope="session")
def stories_weights():
    from halo.model.loader import load_weights

    return load_weights()


@pytest.fixture
def nack_reserve():
    """(weights, context, agent=True) -> what a device's group budget leaves the vectors its UDP endpoint keeps for
    NACKs (a prompt's pass sends the largest; an agent keeps PARTIALS_KEPT, the master more): tests that give a small
    --memory-budget add it."""
    from halo.generation.generate import largest_pass_vector_bytes
    from halo.transport.udp import PARTIALS_KEPT, kept_bytes

    def reserve(weights, context: int, agent: bool = True) -> int:
        largest = largest_pass_vector_bytes(weights.config.dim, context)
        return kept_bytes(largest, PARTIALS_KEPT) if agent else kept_bytes(largest)

    return reserve
