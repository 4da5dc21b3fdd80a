"""Grid-feature extraction with a random-init (or local-weights) torchvision ResNet on CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmvl.data.features import LMDBFeatureReader
from mmvl.data.features.extract import build_backbone, cell_boxes, extract_grid_features
from mmvl.errors import UserError

SIZES = {"red": (40, 30), "green": (64, 64), "sub/blue": (20, 90)}


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    for name, (w, h) in SIZES.items():
        path = tmp_path / "images" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    (tmp_path / "images" / "notes.txt").write_text("not an image")
    return tmp_path


def test_resnet18_grid_features_per_image(images):
    torch.manual_seed(0)
    path, count = extract_grid_features(str(images / "images"), str(images / "g.lmdb"), backbone="resnet18",
                                        image_size=64, batch_size=2)
    reader = LMDBFeatureReader(path, max_features=None)
    assert count == 3 and reader.ids() == ["green", "red", "sub/blue"]
    for name, (w, h) in SIZES.items():
        out = reader[name]
        assert out["features"].shape == (4, 512) and out["features"].dtype == torch.float32  # 64/32 = 2x2 grid
        assert torch.isfinite(out["features"]).all() and out["features"].abs().sum() > 0
        assert (out["image_width"], out["image_height"], out["num_boxes"]) == (w, h, 4)
        assert out["boxes"].tolist() == [[0, 0, .5, .5], [.5, 0, 1, .5], [0, .5, .5, 1], [.5, .5, 1, 1]]


def test_local_weights_load_and_are_used(images, tmp_path):
    torch.manual_seed(1)
    weights = tmp_path / "r18.pth"
    import torchvision

    torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    outs = []
    for run in range(2):
        torch.manual_seed(100 + run)  # a different random init each time: only the weights file decides
        path, _ = extract_grid_features(str(images / "images"), str(tmp_path / f"w{run}.lmdb"), "resnet18",
                                        str(weights), image_size=64, fp16=True)
        outs.append(LMDBFeatureReader(path)["red"]["features"])
    assert outs[0].dtype == torch.float16 and torch.equal(outs[0], outs[1])


def test_bad_inputs_are_user_errors(images, tmp_path):
    with pytest.raises(UserError, match="resnet18"):
        build_backbone("resnet19")
    with pytest.raises(UserError, match="does not exist"):
        build_backbone("resnet18", str(tmp_path / "none.pth"))
    torch.save({"conv1.weight": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(UserError, match="does not match resnet18"):
        build_backbone("resnet18", str(tmp_path / "bad.pth"))
    with pytest.raises(UserError, match="--image-size 16"):
        extract_grid_features(str(images / "images"), str(tmp_path / "x.lmdb"), "resnet18", image_size=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images"):
        extract_grid_features(str(tmp_path / "empty"), str(tmp_path / "x.lmdb"), "resnet18")
    (images / "images" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(UserError, match="broken.jpg cannot be read"):
        extract_grid_features(str(images / "images"), str(tmp_path / "y.lmdb"), "resnet18", image_size=64)


def test_cell_boxes_tile_the_image():
    boxes = cell_boxes(2, 3, 30, 20)
    assert boxes.shape == (6, 4) and boxes[0].tolist() == [0, 0, 10, 10] and boxes[-1].tolist() == [20, 10, 30, 20]
