"""Object regions of Sort-of-CLEVR: each object's pixels and box, once each, in a seeded shuffled order."""
from __future__ import annotations

import numpy as np

from mmvl.data.datasets import sort_of_clevr as soc
from mmvl.data.datasets.sort_of_clevr_regions import object_regions


def test_object_regions_are_each_objects_pixels_and_box_in_a_shuffled_order():
    arrays, _ = soc.generate_split(20, 4, seed=2, size=75, obj=5, background=255)
    regions = object_regions(arrays["images"], arrays["centers"], 5, 255, seed=9)
    assert regions["features"].shape == (20, 6, 13 * 13 * 3) and regions["features"].dtype == np.uint8
    assert regions["boxes"].shape == (20, 6, 4) and regions["boxes"].dtype == np.float32
    colours = np.array(list(soc.COLORS.values()))
    orders = []
    for i in range(20):
        crops = regions["features"][i].reshape(6, 13, 13, 3)
        order = [int(np.flatnonzero((colours == crop[6, 6]).all(1))[0]) for crop in crops]  # colour at the centre
        assert sorted(order) == list(range(6))  # every object once
        orders.append(order)
        for crop, colour, box in zip(crops, order, regions["boxes"][i]):
            painted = int((crop == colours[colour]).all(-1).sum())
            assert painted == (121 if arrays["shapes"][i, colour] == 1 else 81)  # an 11x11 square or a radius-5 disc
            assert (crop[0] == 255).all() and (crop[:, 0] == 255).all()  # the border shows no neighbour
            x, y = arrays["centers"][i, colour]
            np.testing.assert_allclose(box * 75, [x - 5, y - 5, x + 6, y + 6], rtol=0, atol=1e-4)
    assert len({tuple(o) for o in orders}) > 10 and orders[0] != list(range(6))  # not colour order
    again = object_regions(arrays["images"], arrays["centers"], 5, 255, seed=9)
    np.testing.assert_array_equal(again["features"], regions["features"])  # seeded
