//! Buddy copies: a checkpoint file that no other node keeps — a pipeline stage whose replicas
//! all run on one node, a parameter-server shard's, a geo trainer's own state — is also stored on
//! the next node (nodes in the order of their lowest rank in the roster), through the checkpoint
//! mirror of a role there, before the role acknowledges the checkpoint: losing a whole node loses
//! no committed checkpoint. A role whose node came back with an empty disk fetches its file back
//! from that node.

use anyhow::{Context as _, Result};

use crate::actors::recovery::file_mirror::MirrorLine;
use crate::net::protocol::Roster;

/// How a role reaches its buddy node's mirror.
#[derive(Debug, Clone)]
pub struct Buddy {
    /// What a connection to a mirror needs.
    pub line: MirrorLine,
}

impl Buddy {
    /// The rank and mirror on the node after `rank`'s (the lowest rank there that serves one);
    /// `None` when the job runs on one node.
    fn after(roster: &Roster, rank: usize) -> Option<(usize, &str)> {
        let members = roster.members();
        let mut hosts: Vec<&str> = Vec::new();
        for &r in &members {
            let host = roster.host_of(r);
            if !hosts.contains(&host) {
                hosts.push(host);
            }
        }
        let mine = hosts.iter().position(|&h| h == roster.host_of(rank))?;
        let next = hosts.get((mine + 1) % hosts.len()).filter(|&&h| h != hosts[mine])?;
        members
            .into_iter()
            .filter(|&r| roster.host_of(r) == *next)
            .find_map(|r| Some((r, roster.mirror_of(r)?)))
    }

    /// Whether every rank in `holders` (those keeping the same state) runs on `rank`'s node: then
    /// no other node keeps it.
    pub fn only_here(roster: &Roster, rank: usize, holders: impl IntoIterator<Item = usize>) -> bool {
        holders
            .into_iter()
            .all(|other| roster.host_of(other) == roster.host_of(rank))
    }

    /// Stores `rank`'s file `name` of step `step` on the next node, and says which host that is;
    /// does nothing on one node.
    pub async fn copy(
        &self,
        roster: &Roster,
        rank: usize,
        step: usize,
        name: &str,
        bytes: &[u8],
    ) -> Result<Option<String>> {
        let Some((buddy, mirror)) = Self::after(roster, rank) else {
            return Ok(None);
        };
        self.line
            .store(mirror, step, name, bytes)
            .await
            .with_context(|| format!("rank {rank}: the buddy copy of {name} (step {step}) on rank {buddy}'s node"))?;
        tracing::debug!(rank, step, name, buddy, "buddy copy stored");
        Ok(Some(roster.host_of(buddy).to_string()))
    }

    /// `rank`'s file `name` of step `step`, from the node after its own, and where it came from.
    pub async fn fetch(&self, roster: &Roster, rank: usize, step: usize, name: &str) -> Result<(Vec<u8>, String)> {
        let (buddy, mirror) = Self::after(roster, rank)
            .with_context(|| format!("rank {rank}: no other node keeps a buddy copy of {name} (step {step})"))?;
        let bytes = self.line.fetch(mirror, step, name).await?;
        Ok((bytes, format!("buddy rank {buddy}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roster(endpoints: &[&str], mirrors: &[Option<&str>]) -> Roster {
        Roster {
            members: (0..endpoints.len()).collect(),
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            mirrors: mirrors.iter().map(|m| m.map(str::to_string)).collect(),
            generation: 0,
            resume_step: None,
            record: None,
        }
    }

    #[test]
    fn the_buddy_is_the_next_node_in_roster_order_wrapping_around() {
        let r = roster(
            &["10.0.0.1:1", "10.0.0.2:1", "10.0.0.1:2", "10.0.0.3:1"],
            &[Some("10.0.0.1:9"), None, Some("10.0.0.1:8"), Some("10.0.0.3:9")],
        );
        // Node 10.0.0.2's only rank serves no mirror: no buddy there for node 10.0.0.1.
        assert_eq!(Buddy::after(&r, 0), None);
        assert_eq!(Buddy::after(&r, 1), Some((3, "10.0.0.3:9")));
        assert_eq!(Buddy::after(&r, 3), Some((0, "10.0.0.1:9")));
        let one_node = roster(&["10.0.0.1:1", "10.0.0.1:2"], &[Some("a:1"), Some("a:2")]);
        assert_eq!(Buddy::after(&one_node, 0), None);
        assert!(Buddy::only_here(&r, 0, [0, 2]));
        assert!(!Buddy::only_here(&r, 0, [0, 1]));
    }
}
