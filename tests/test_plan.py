import pytest

from exatrain.plan import Plan, PlanError


def test_degrees_and_world_size():
    plan = Plan(data=2, space=(1, 2, 2))
    assert plan.world_size == 8
    assert plan.degrees() == {"trainer": 1, "pipe": 1, "data": 2, "shard": 1, "space_d": 1,
                              "space_h": 2, "space_w": 2, "tensor": 1}
    assert Plan(space=(2, 2)).space == (1, 2, 2)
    assert Plan(tensor=(2, 1, 2)).degrees()["tensor_z"] == 2 and Plan(tensor=(2, 1, 2)).tensor_3d
    assert Plan(tensor=4).tensor_degree == 4 and not Plan(tensor=4).tensor_3d


def test_product_must_equal_world_size_and_message_suggests_a_fix():
    with pytest.raises(PlanError, match=r"needs 6 ranks but the job has 8.*data=4"):
        Plan(data=3, space=(1, 1, 2)).validate(8)
    with pytest.raises(PlanError, match=r"does not divide 6.*divisors of 6: \[1, 2, 3, 6\]"):
        Plan(data=1, shard=4).validate(6)
    Plan(data=4).validate(4)


def test_for_world_fills_data():
    assert Plan.for_world(8, space=(1, 2, 2)) == Plan(data=2, space=(1, 2, 2))
    with pytest.raises(PlanError, match="does not divide the world size 6"):
        Plan.for_world(6, shard=4)


def test_bad_degrees_are_refused():
    with pytest.raises(PlanError, match="positive integer"):
        Plan(data=0)
    with pytest.raises(PlanError, match="1 to 3 degrees"):
        Plan(space=(1, 1, 1, 2))


def test_every_axis_is_implemented_and_clashes_are_refused():
    from exatrain.plan import AXIS_ORDER, IMPLEMENTED_AXES
    assert IMPLEMENTED_AXES == set(AXIS_ORDER)
    Plan(trainer=2, pipe=2, data=2).require_implemented()
    Plan(data=8).require_implemented()
    Plan(pipe=2, data=4).require_implemented()
    Plan(pipe=2, tensor=2).require_implemented()
    Plan(pipe=2, data=2, tensor=(1, 1, 2)).require_implemented()
    Plan(pipe=2, shard=2, tensor=2).require_implemented()
    Plan(pipe=2, space=(1, 1, 2), data=2).require_implemented()


def test_composition_rules_accept_and_refuse_with_the_nearest_plan():
    for plan in (Plan(data=2, tensor=(2, 1, 2)), Plan(shard=2, tensor=2),
                 Plan(data=2, shard=2, tensor=2), Plan(shard=2, space=(1, 1, 2)),
                 Plan(data=2, shard=2, space=(1, 2, 1)), Plan(space=(1, 2, 1), tensor=2)):
        assert plan.require_implemented() is plan
    with pytest.raises(PlanError, match=r"tensor_z already.*Plan\(tensor=\(2, 1, 4\)\)"):
        Plan(shard=2, tensor=(2, 1, 2)).require_implemented()
    with pytest.raises(PlanError, match=r"Plan\(space=\(1, 2, 1\), tensor=4\)"):
        Plan(space=(1, 2, 1), tensor=(2, 1, 2)).require_implemented()
