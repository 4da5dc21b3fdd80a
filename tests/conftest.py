import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(params=[0o022, 0o002, 0o077], ids=["umask022", "umask002", "umask077"])
def umask(request):
    """Run the test under each umask (the process's, restored after)."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)
