"""PairwiseRelation: the pair sum equals g on every concatenated pair, the mean and first-object
weightings, the pair geometry, and cell coordinates that follow the grid."""
from __future__ import annotations

import pytest
import torch

from mmvl.errors import UserError
from mmvl.models.modules.relation import GEOMETRY_DIM, PairwiseRelation, cell_coordinates, pair_geometry


def test_pair_sum_equals_g_on_every_concatenated_pair():
    torch.manual_seed(0)
    rel = PairwiseRelation(object_dim=4, question_dim=3, hidden_sizes=[6, 5])
    objects, question = torch.randn(2, 5, 4), torch.randn(2, 3)
    first = torch.cat([rel.left.weight, rel.right.weight, rel.question.weight], dim=1)  # one layer on [o_i; o_j; q]
    expected = torch.zeros(2, 5)
    for b in range(2):
        for i in range(5):
            for j in range(5):
                pair = torch.cat([objects[b, i], objects[b, j], question[b]])
                expected[b] += rel.rest(torch.relu(first @ pair + rel.question.bias))
    torch.testing.assert_close(rel(objects, question), expected, rtol=1e-5, atol=1e-5)


def test_mean_reduction_is_the_sum_over_the_pair_count():
    torch.manual_seed(0)
    summed = PairwiseRelation(4, 3, [6, 5])
    averaged = PairwiseRelation(4, 3, [6, 5], reduction="mean")
    averaged.load_state_dict(summed.state_dict())
    objects, question = torch.randn(2, 5, 4), torch.randn(2, 3)
    torch.testing.assert_close(averaged(objects, question) * 25, summed(objects, question))
    with pytest.raises(UserError, match="pair_reduction"):
        PairwiseRelation(4, 3, [6], reduction="max")


def test_cell_coordinates_follow_the_flattened_grid():
    coords = cell_coordinates(2, 3, torch.device("cpu"), torch.float32)
    grid = torch.arange(6.0).view(1, 1, 2, 3)
    assert grid.flatten(2)[0, 0, 4] == grid[0, 0, 1, 1]  # row-major: cell 4 is row 1, column 1
    torch.testing.assert_close(coords[4], torch.tensor([0.0, 1.0]))  # x of the middle column, y of the last row
    torch.testing.assert_close(coords[0], torch.tensor([-1.0, -1.0]))
    torch.testing.assert_close(coords[5], torch.tensor([1.0, 1.0]))


def test_first_object_weights_replace_the_pair_sum():
    torch.manual_seed(0)
    rel = PairwiseRelation(4, 3, [6, 5])
    objects, question = torch.randn(2, 5, 4), torch.randn(2, 3)
    first = torch.softmax(torch.randn(2, 5), -1)
    per_pair = rel.rest(torch.relu(rel.left(objects).unsqueeze(2) + rel.right(objects).unsqueeze(1)
                                   + rel.question(question)[:, None, None, :]))  # B x i x j x H
    expected = (per_pair * first[:, :, None, None]).sum(dim=(1, 2))
    torch.testing.assert_close(rel(objects, question, None, first), expected)
    uniform = torch.full((2, 5), 1 / 5)
    torch.testing.assert_close(rel(objects, question, None, uniform) * 5, rel(objects, question))  # = the plain sum


def test_pair_geometry_is_both_positions_their_offset_and_distance():
    positions = torch.tensor([[[-1.0, 0.0], [0.5, 0.5], [0.2, -0.6]]])
    geometry = pair_geometry(positions)
    assert geometry.shape == (1, 3, 3, GEOMETRY_DIM)
    for i in range(3):
        for j in range(3):
            offset = positions[0, i] - positions[0, j]
            expected = torch.cat([positions[0, i], positions[0, j], offset, offset.norm().view(1)])
            torch.testing.assert_close(geometry[0, i, j], expected, atol=1e-5, rtol=0)


def test_pair_geometry_enters_g_first_layer():
    torch.manual_seed(0)
    rel = PairwiseRelation(4, 3, [6, 5], geometry=True)
    objects, question, positions = torch.randn(2, 5, 4), torch.randn(2, 3), torch.rand(2, 5, 2) * 2 - 1
    per_pair = rel.rest(torch.relu(rel.left(objects).unsqueeze(2) + rel.right(objects).unsqueeze(1)
                                   + rel.question(question)[:, None, None, :]
                                   + rel.geometry(pair_geometry(positions))))
    torch.testing.assert_close(rel(objects, question, positions=positions), per_pair.sum(dim=(1, 2)))
    moved = positions.clone()
    moved[:, 0] += 0.3
    assert not torch.allclose(rel(objects, question, positions=moved), rel(objects, question, positions=positions))
    with pytest.raises(ValueError, match="positions"):
        rel(objects, question)
    with pytest.raises(ValueError, match="positions"):
        PairwiseRelation(4, 3, [6])(objects, question, positions=positions)
