//! Healing from a peer: after a rollback every rank must hold the same state, but some hold it
//! (in memory, or on their node's disk) and some do not (a replacement on a node whose disk is
//! empty). The ranks that lack it receive it from one that holds it, along the ring, checked
//! against the checksum every holder announced.

use anyhow::{bail, ensure, Result};

use super::Communicator;

/// Where a rank's copy of a shared state came from.
#[derive(Debug, PartialEq, Eq)]
pub enum Shared {
    /// It held the state already.
    Held,
    /// It received the state from rank `from`.
    Received {
        /// The state.
        bytes: Vec<u8>,
        /// The rank that sent it.
        from: usize,
    },
}

/// What a rank announces of its copy: its length (0: none) and CRC-32C.
const ANNOUNCEMENT: usize = 12;

impl Communicator {
    /// Gives `what` — a state every rank must hold, `mine` where this rank holds it — to the
    /// ranks that lack it. Refused when no rank holds it, or when two holders' copies differ.
    pub fn share(&mut self, what: &str, mine: Option<&[u8]>) -> Result<Shared> {
        let n = self.world_size();
        let mut announced = [0u8; ANNOUNCEMENT];
        if let Some(bytes) = mine {
            ensure!(!bytes.is_empty(), "{what}: an empty state cannot be shared");
            announced[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
            announced[8..].copy_from_slice(&crc32c::crc32c(bytes).to_le_bytes());
        }
        let copies: Vec<(u64, u32)> = self
            .all_gather(&format!("{what}: who holds it"), &announced)?
            .iter()
            .map(|a| {
                let (mut len, mut crc) = ([0u8; 8], [0u8; 4]);
                len.copy_from_slice(&a[..8]);
                crc.copy_from_slice(&a[8..ANNOUNCEMENT]);
                (u64::from_le_bytes(len), u32::from_le_bytes(crc))
            })
            .collect();
        let holders: Vec<usize> = (0..n).filter(|&r| copies[r].0 > 0).collect();
        let Some(&first) = holders.first() else {
            bail!("{what}: no rank holds it (not in memory, not on its node's disk)");
        };
        if let Some(&other) = holders.iter().find(|&&r| copies[r] != copies[first]) {
            bail!(
                "{what}: ranks {first} and {other} hold different copies ({} bytes, CRC-32C {:08x}; {} bytes, {:08x})",
                copies[first].0,
                copies[first].1,
                copies[other].0,
                copies[other].1
            );
        }
        let lacking: Vec<usize> = (0..n).filter(|&r| copies[r].0 == 0).collect();
        if lacking.is_empty() {
            return Ok(Shared::Held);
        }
        // The holder with the shortest chain to every rank that lacks the state sends it: with
        // one replacement, its ring predecessor if that holds it, so one hop carries it.
        let reach_from = |root: usize| lacking.iter().map(|&l| (l + n - root) % n).max().unwrap_or(0);
        let root = holders.iter().copied().min_by_key(|&h| reach_from(h)).unwrap_or(first);
        let reach = reach_from(root);
        let op = format!("{what}: from rank {root}");
        if let (Some(bytes), 0) = (mine, self.position_after(root)) {
            self.relay_from_root(&op, bytes, reach)?;
            return Ok(Shared::Held);
        }
        let (len, crc) = copies[root];
        let len = usize::try_from(len)?;
        if self.position_after(root) > reach {
            return Ok(Shared::Held);
        }
        let mut bytes = vec![0u8; len];
        self.relay(&op, &mut bytes, root, reach)?;
        if mine.is_some() {
            return Ok(Shared::Held);
        }
        ensure!(
            crc32c::crc32c(&bytes) == crc,
            "{op}: the received copy does not match its checksum"
        );
        Ok(Shared::Received { bytes, from: root })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engines::comm::memory;

    /// Runs `share` on a ring of `n` where the ranks in `holding` hold `state(rank)`.
    fn share_on_ring(n: usize, holding: &[usize], state: impl Fn(usize) -> Vec<u8> + Sync) -> Vec<Result<Shared>> {
        let transports = memory::ring(n, Duration::from_secs(10));
        std::thread::scope(|s| {
            let handles: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(rank, t)| {
                    let mine = holding.contains(&rank).then(|| state(rank));
                    s.spawn(move || Communicator::new(Box::new(t)).share("state of step 10", mine.as_deref()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn the_ranks_that_lack_a_state_receive_it_from_a_holder() {
        let state: Vec<u8> = (0..100_003u32).map(|i| (i * 7 % 251) as u8).collect();
        for n in 1..=4 {
            for holders in 1u32..(1 << n) {
                let holding: Vec<usize> = (0..n).filter(|r| holders & (1 << r) != 0).collect();
                let results = share_on_ring(n, &holding, |_| state.clone());
                for (rank, result) in results.into_iter().enumerate() {
                    match result.unwrap() {
                        Shared::Held => assert!(holding.contains(&rank), "n={n} {holding:?}: rank {rank}"),
                        Shared::Received { bytes, from } => {
                            assert!(!holding.contains(&rank) && holding.contains(&from));
                            assert!(bytes == state, "n={n} {holding:?}: rank {rank} got another state");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_nearest_holder_before_a_replacement_sends_it() {
        let results = share_on_ring(4, &[0, 1, 3], |_| vec![7; 64]);
        assert_eq!(
            results[2].as_ref().unwrap(),
            &Shared::Received {
                bytes: vec![7; 64],
                from: 1
            }
        );
    }

    #[test]
    fn no_holder_and_differing_holders_are_refused_by_every_rank() {
        for result in share_on_ring(3, &[], |_| vec![1]) {
            let error = result.unwrap_err().to_string();
            assert!(error.contains("state of step 10: no rank holds it"), "{error}");
        }
        for result in share_on_ring(3, &[0, 2], |rank| vec![rank as u8; 8]) {
            let error = result.unwrap_err().to_string();
            assert!(error.contains("ranks 0 and 2 hold different copies"), "{error}");
        }
    }
}
