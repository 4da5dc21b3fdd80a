import pytest


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """One generated copy of the tiny configs' data (tests/models/tiny/_data.yaml) for every model test."""
    return tmp_path_factory.mktemp("tiny_data")
