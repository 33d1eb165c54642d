"""A ring collective across nodes uses every member's NIC (plan_cluster.ClusterSpec.ring_link)."""
import pytest

from labkit.theory import plan_terms, planner


@pytest.fixture(scope="module")
def cluster():
    return planner.make_cluster("H100", 64)    # 8 nodes of 8, NVLink 4 inside, NDR across


def test_inside_a_node_the_ring_runs_on_nvlink(cluster):
    assert cluster.ring_link(8, 8) == cluster.intra


def test_one_member_per_node_gets_one_nic(cluster):
    # a DP group of 8 with TP 8 filling each node: one member in each of the 8 nodes
    assert cluster.ring_link(8, 64) == cluster.inter


@pytest.mark.parametrize("per_node", [2, 4])
def test_k_members_per_node_move_bytes_over_k_nics(cluster, per_node):
    link = cluster.ring_link(8 * per_node, 64)
    assert link.effective_bandwidth == pytest.approx(
        per_node * cluster.inter.effective_bandwidth)


def test_never_faster_than_the_node_itself(cluster):
    # 8 members per node over 8 NICs would pass 8 x 40 GB/s; NVLink's effective rate caps it
    link = cluster.ring_link(64, 64)
    assert link.effective_bandwidth == pytest.approx(min(
        8 * cluster.inter.effective_bandwidth, cluster.intra.effective_bandwidth))
    assert link.effective_bandwidth <= cluster.intra.effective_bandwidth


def test_the_planners_dp_reduction_uses_the_ring_link(cluster):
    """The same 1B-parameter stage reduced over 16 ranks: spread 2 per node (span 64) it takes
    half as long as spread 1 per node (span 128 of a 128-GPU cluster) for large messages."""
    big = planner.make_cluster("H100", 128)
    two, _, _ = plan_terms.dp_traffic(big, 1e9, 1, 16, 64)
    one, _, _ = plan_terms.dp_traffic(big, 1e9, 1, 16, 128)
    assert two == pytest.approx(one / 2, rel=0.01)
