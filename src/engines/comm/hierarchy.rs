//! The hierarchical all-reduce's layout and rings. With several ranks on each of several
//! nodes, a flat ring sends `2(n-1)/n` of every buffer across the network from every rank;
//! reduce-scatter inside the node (shared memory), all-reduce of each rank's `1/per_node` share
//! across the nodes (one "rail" ring per local index, TCP), and all-gather inside the node send
//! `per_node` times less between nodes. The sums are associated differently from the flat
//! ring's, so the two differ in the last bits (each is deterministic and bit-identical on every
//! rank).

use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Context, Result};

use super::{Communicator, RingLinks, RingPlace};
use crate::config::JobConfig;

/// Ranks on nodes: `nodes` nodes of `per_node` ranks, rank `node·per_node + local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeLayout {
    /// Nodes.
    pub nodes: usize,
    /// Ranks on each node.
    pub per_node: usize,
}

impl NodeLayout {
    /// The nodes `config` gives its collective job (`cluster.nnodes` × `nproc_per_node`).
    pub fn configured(config: &JobConfig) -> Self {
        Self {
            nodes: config.cluster.nnodes,
            per_node: config.cluster.nproc_per_node,
        }
    }

    /// The ranks of node `node`, in ring order.
    fn node_ranks(&self, node: usize) -> Vec<usize> {
        (0..self.per_node).map(|local| node * self.per_node + local).collect()
    }

    /// The ranks of local index `local`, one per node, in ring order.
    fn rail_ranks(&self, local: usize) -> Vec<usize> {
        (0..self.nodes).map(|node| node * self.per_node + local).collect()
    }

    /// Whether the layout has two levels to split (several nodes of several ranks).
    fn is_layered(&self) -> bool {
        self.nodes > 1 && self.per_node > 1
    }

    /// The layout of the hosts of `endpoints` (by rank): equal numbers of consecutive ranks on
    /// each host; else why not.
    pub fn of_hosts(endpoints: &[SocketAddr]) -> std::result::Result<Self, String> {
        let mut hosts: Vec<(IpAddr, usize)> = Vec::new();
        for endpoint in endpoints {
            let ip = endpoint.ip();
            let seen = hosts.iter().position(|(host, _)| *host == ip);
            match seen {
                Some(last) if last + 1 == hosts.len() => hosts[last].1 += 1,
                Some(_) => return Err(format!("the ranks of host {ip} are not consecutive")),
                None => hosts.push((ip, 1)),
            }
        }
        let per_node = hosts.first().map_or(0, |(_, count)| *count);
        if let Some((host, count)) = hosts.iter().find(|(_, count)| *count != per_node) {
            return Err(format!(
                "host {host} has {count} rank(s), host {} has {per_node}",
                hosts[0].0
            ));
        }
        Ok(Self {
            nodes: hosts.len(),
            per_node,
        })
    }
}

/// The layout a job's all-reduce runs hierarchically over, if any: `setting` is
/// `strategy.use_hierarchical_allreduce` (unset: whenever the ranks' hosts make two levels;
/// `false`: never; `true`: over the hosts, or where all ranks share one host over the config's
/// `configured` nodes). `endpoints` are the ranks' data endpoints (none in one process).
pub fn choose(
    setting: Option<bool>,
    endpoints: Option<&[SocketAddr]>,
    configured: NodeLayout,
) -> Result<Option<NodeLayout>> {
    let hosts = endpoints.map(NodeLayout::of_hosts);
    match (setting, hosts) {
        (Some(false), _) => Ok(None),
        (None, Some(Ok(layout))) => Ok(layout.is_layered().then_some(layout)),
        (None, _) => Ok(None),
        (Some(true), Some(Ok(layout))) if layout.nodes > 1 => {
            if !layout.is_layered() {
                bail!("strategy.use_hierarchical_allreduce = true, but each of the {} hosts has one rank", layout.nodes)
            }
            Ok(Some(layout))
        }
        (Some(true), Some(Err(why))) => bail!("strategy.use_hierarchical_allreduce = true, but {why}"),
        (Some(true), _) if configured.is_layered() => Ok(Some(configured)),
        (Some(true), _) => bail!(
            "strategy.use_hierarchical_allreduce = true needs several nodes of several ranks, but the job has {} node(s) of {}",
            configured.nodes,
            configured.per_node
        ),
    }
}

/// Rank `rank`'s communicator over the processes at `links.endpoints`: the flat ring, and the
/// node and rail rings of a hierarchical all-reduce where `setting`
/// (`strategy.use_hierarchical_allreduce`) and the ranks' hosts choose one (see [`choose`]).
pub fn connect_communicator(
    rank: usize,
    links: &RingLinks,
    setting: Option<bool>,
    configured: NodeLayout,
) -> Result<Communicator> {
    let flat = Communicator::new(links.connect(RingPlace::identity(rank, links.endpoints.len()))?);
    match choose(setting, Some(links.endpoints), configured)? {
        Some(layout) => connect_levels(flat, layout, links),
        None => Ok(flat),
    }
}

/// `flat`, the connected flat ring of `rank`, with its node and rail rings over `layout`
/// connected too. A listener takes a hello only from its ring-left neighbour, so the rings are
/// connected one after another, every rank done with one (a barrier on the flat ring) before
/// any starts the next.
fn connect_levels(flat: Communicator, layout: NodeLayout, links: &RingLinks) -> Result<Communicator> {
    let mut flat = flat;
    let rank = flat.rank();
    let (node, local) = (rank / layout.per_node, rank % layout.per_node);
    let ring = |ranks: Vec<usize>, position: usize, name: &str| -> Result<_> {
        links
            .connect(RingPlace::new(position, ranks)?)
            .with_context(|| format!("rank {rank}: connecting {name}"))
    };
    flat.barrier("flat ring connected")?;
    let node_ring = ring(layout.node_ranks(node), local, &format!("the ring of node {node}"))?;
    flat.barrier("node rings connected")?;
    let rail_ring = ring(
        layout.rail_ranks(local),
        node,
        &format!("the rail ring of local rank {local}"),
    )?;
    tracing::info!(
        rank,
        nodes = layout.nodes,
        per_node = layout.per_node,
        "hierarchical all-reduce: node and rail rings connected"
    );
    Ok(flat.into_levels(node_ring, rail_ring))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::comm::memory;
    use std::time::Duration;

    /// Communicators for the `world` ranks of one process, over rings in memory: hierarchical over
    /// `layout` when given (jobs take named rings of [`MemoryRings`](super::memory::MemoryRings)).
    pub(crate) fn memory_communicators(
        world: usize,
        layout: Option<NodeLayout>,
        timeout: Duration,
    ) -> Vec<Communicator> {
        let flat = memory::ring(world, timeout);
        let Some(layout) = layout else {
            return flat.into_iter().map(|end| Communicator::new(Box::new(end))).collect();
        };
        // Each rank's end of its node's ring and of its rail's, by rank.
        let nodes = ends_by_rank(world, (0..layout.nodes).map(|node| layout.node_ranks(node)), timeout);
        let rails = ends_by_rank(
            world,
            (0..layout.per_node).map(|local| layout.rail_ranks(local)),
            timeout,
        );
        flat.into_iter()
            .zip(nodes.into_iter().zip(rails))
            .filter_map(|(flat, (node, rail))| {
                Some(Communicator::new(Box::new(flat)).into_levels(Box::new(node?), Box::new(rail?)))
            })
            .collect()
    }

    /// A ring in memory over each group of ranks of `groups`, its ends by rank.
    fn ends_by_rank(
        world: usize,
        groups: impl Iterator<Item = Vec<usize>>,
        timeout: Duration,
    ) -> Vec<Option<memory::MemoryTransport>> {
        let mut ends: Vec<Option<memory::MemoryTransport>> = (0..world).map(|_| None).collect();
        for ranks in groups {
            let ring = memory::ring(ranks.len(), timeout);
            for (rank, end) in ranks.into_iter().zip(ring) {
                ends[rank] = Some(end);
            }
        }
        ends
    }

    use crate::engines::comm::Wire;

    fn endpoints(hosts: &[&str]) -> Vec<SocketAddr> {
        hosts
            .iter()
            .enumerate()
            .map(|(i, host)| format!("{host}:{}", 7000 + i).parse().unwrap())
            .collect()
    }

    #[test]
    fn the_layout_comes_from_the_hosts_and_the_setting() -> Result<()> {
        let two_by_two = endpoints(&["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]);
        let layout = NodeLayout { nodes: 2, per_node: 2 };
        let configured = NodeLayout { nodes: 1, per_node: 4 };
        assert_eq!(choose(None, Some(&two_by_two), configured)?, Some(layout));
        assert_eq!(choose(Some(false), Some(&two_by_two), configured)?, None);
        assert_eq!((layout.node_ranks(1), layout.rail_ranks(1)), (vec![2, 3], vec![1, 3]));
        // One host, or one rank per host: flat unless asked, and then the config's nodes.
        let one_host = endpoints(&["127.0.0.1"; 4]);
        assert_eq!(choose(None, Some(&one_host), configured)?, None);
        assert_eq!(
            choose(None, Some(&endpoints(&["10.0.0.1", "10.0.0.2"])), configured)?,
            None
        );
        assert_eq!(choose(Some(true), Some(&one_host), layout)?, Some(layout));
        assert_eq!(choose(Some(true), None, layout)?, Some(layout));
        let uneven = endpoints(&["10.0.0.1", "10.0.0.1", "10.0.0.2"]);
        assert_eq!(choose(None, Some(&uneven), configured)?, None);
        let error = choose(Some(true), Some(&uneven), configured).unwrap_err().to_string();
        assert_eq!(
            error,
            "strategy.use_hierarchical_allreduce = true, but host 10.0.0.2 has 1 rank(s), host 10.0.0.1 has 2"
        );
        let scattered = endpoints(&["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2"]);
        assert!(choose(Some(true), Some(&scattered), configured)
            .unwrap_err()
            .to_string()
            .contains("the ranks of host 10.0.0.1 are not consecutive"));
        assert!(choose(Some(true), None, configured).is_err());
        Ok(())
    }

    #[test]
    fn the_hierarchical_all_reduce_sums_as_the_flat_one_and_agrees_on_every_rank() -> Result<()> {
        for (len, wire) in CASES.into_iter().flat_map(|len| [(len, Wire::F32), (len, Wire::Bf16)]) {
            let results = on_every_rank(|c| {
                let mut data = rank_values(c.rank(), len);
                c.all_reduce_sum_as("test", &mut data, wire).map(|()| data)
            })?;
            assert_sums(&results, len, wire);
        }
        Ok(())
    }

    /// The hierarchical reduce-scatter leaves each rank the sums of its shard (a rail's shard of
    /// a node's share), and the all-gather of the shards alone hands every rank the whole sum.
    #[test]
    fn the_hierarchical_reduce_scatter_and_all_gather_make_an_all_reduce() -> Result<()> {
        for (len, wire) in CASES.into_iter().flat_map(|len| [(len, Wire::F32), (len, Wire::Bf16)]) {
            let results = on_every_rank(|c| scatter_then_gather(c, len, wire).map(|(_, gathered)| gathered))?;
            assert_sums(&results, len, wire);
        }
        Ok(())
    }

    /// Sharding inside the nodes: a rank's shard is its node's share, the same on every node, and
    /// the reduce-scatter and all-gather of the shards still make an all-reduce.
    #[test]
    fn shards_within_the_nodes_are_the_node_shares_summed_over_all_ranks() -> Result<()> {
        let layout = NodeLayout { nodes: 3, per_node: 2 };
        for (len, wire) in CASES.into_iter().flat_map(|len| [(len, Wire::F32), (len, Wire::Bf16)]) {
            let communicators = memory_communicators(6, Some(layout), Duration::from_secs(10))
                .into_iter()
                .map(Communicator::sharding_within_nodes)
                .collect::<Result<Vec<_>>>()?;
            let results = on_every_rank_of(communicators, |c| {
                let (shard, gathered) = scatter_then_gather(c, len, wire)?;
                let local = c.rank() % layout.per_node;
                let share = (local + 1) % 2 * len / 2..((local + 1) % 2 + 1) * len / 2;
                anyhow::ensure!(
                    shard == share,
                    "rank {}: shard {shard:?}, its node share {share:?}",
                    c.rank()
                );
                Ok(gathered)
            })?;
            assert_sums(&results, len, wire);
        }
        let flat = memory_communicators(2, None, Duration::from_secs(1)).remove(0);
        let refused = flat
            .sharding_within_nodes()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(refused.contains("needs the hierarchical rings"), "{refused}");
        Ok(())
    }

    /// A reduce-scatter of this rank's values of `len`, then the all-gather of the shard alone
    /// (the rest of the buffer NaN): the shard, and the buffer every rank ends with.
    fn scatter_then_gather(c: &mut Communicator, len: usize, wire: Wire) -> Result<(std::ops::Range<usize>, Vec<f32>)> {
        let mut data = rank_values(c.rank(), len);
        let shard = c.reduce_scatter_sum_as("scatter", &mut data, wire)?;
        anyhow::ensure!(shard == c.shard_of(len), "the shard returned is shard_of's");
        let mut gathered = vec![f32::NAN; len];
        gathered[shard.clone()].copy_from_slice(&data[shard.clone()]);
        c.all_gather_shards_as("gather", &mut gathered, wire)?;
        Ok((shard, gathered))
    }

    /// Buffer lengths of the hierarchical tests: empty, fewer values than ranks, uneven shares.
    const CASES: [usize; 5] = [0, 1, 5, 1031, 200_003];

    /// Multiples of 1/8 below 1000: every sum of them is exact in any order.
    fn rank_values(rank: usize, len: usize) -> Vec<f32> {
        (0..len).map(|i| ((rank * 7919 + i * 31) % 1000) as f32 / 8.0).collect()
    }

    /// `work` on every rank of six in memory, hierarchical over 3 nodes of 2: each rank's result.
    fn on_every_rank<T: Send>(work: impl Fn(&mut Communicator) -> Result<T> + Sync) -> Result<Vec<T>> {
        let layout = NodeLayout { nodes: 3, per_node: 2 };
        on_every_rank_of(memory_communicators(6, Some(layout), Duration::from_secs(10)), work)
    }

    /// `work` on every one of `communicators`, each on a thread of its own: each one's result.
    fn on_every_rank_of<T: Send>(
        communicators: Vec<Communicator>,
        work: impl Fn(&mut Communicator) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = communicators
                .into_iter()
                .map(|mut c| {
                    let work = &work;
                    s.spawn(move || work(&mut c))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// Every rank's `results` are the sums of the six ranks' values: exactly on an `f32` wire;
    /// on a bfloat16 wire the same bits everywhere, within the bound of `wire` (the values are
    /// positive, so the sum of magnitudes is the sum).
    fn assert_sums(results: &[Vec<f32>], len: usize, wire: Wire) {
        let inputs: Vec<Vec<f32>> = (0..6).map(|r| rank_values(r, len)).collect();
        let expected: Vec<f32> = (0..len).map(|i| inputs.iter().map(|b| b[i]).sum()).collect();
        if wire == Wire::F32 {
            for result in results {
                assert_eq!(*result, expected, "len {len}");
            }
            return;
        }
        for (i, &exact) in expected.iter().enumerate() {
            let bound = 6.0 * crate::engines::comm::wire::BF16_ROUNDING * exact;
            assert!((results[0][i] - exact).abs() <= bound, "len {len} i {i}");
        }
        for result in results {
            let same = result.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "len {len}: the ranks disagree");
        }
    }
}
