//! Where a member sits in a ring, and which global rank holds every place: the collectives
//! count ring positions, while errors name the job's ranks.

use std::fmt;

use anyhow::{ensure, Result};

/// A member's position in a ring and the global rank at each position. A data-parallel ring
/// over every rank of the job is the identity; a pipeline's sub-rings are not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPlace {
    position: usize,
    ranks: Vec<usize>,
}

impl RingPlace {
    /// `rank` in a ring over ranks `0..world_size`, in order.
    pub fn identity(rank: usize, world_size: usize) -> Self {
        Self {
            position: rank,
            ranks: (0..world_size).collect(),
        }
    }

    /// The member at `position` of a ring over the global `ranks`, in ring order.
    pub fn new(position: usize, ranks: Vec<usize>) -> Result<Self> {
        ensure!(
            position < ranks.len(),
            "ring position {position} is outside a ring over ranks {ranks:?}"
        );
        Ok(Self { position, ranks })
    }

    /// This member's position, `0..world_size`.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Members of the ring.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// The global ranks of the ring, in ring order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// This member's global rank.
    pub fn rank(&self) -> usize {
        self.rank_at(self.position)
    }

    /// The global rank at `position`; a position outside the ring (a peer's claim) as is.
    pub fn rank_at(&self, position: usize) -> usize {
        self.ranks.get(position).copied().unwrap_or(position)
    }

    /// The position to the right, which this member sends to.
    pub fn right(&self) -> usize {
        (self.position + 1) % self.world_size()
    }

    /// The position to the left, which this member receives from.
    pub fn left(&self) -> usize {
        (self.position + self.world_size() - 1) % self.world_size()
    }

    fn is_identity(&self) -> bool {
        self.ranks.iter().enumerate().all(|(position, &rank)| position == rank)
    }
}

/// "rank 3 of 4" on a ring over the whole job, "rank 5 at position 1 of the ring over ranks
/// [2, 5]" on a sub-ring.
impl fmt::Display for RingPlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_identity() {
            write!(f, "rank {} of {}", self.rank(), self.world_size())
        } else {
            write!(
                f,
                "rank {} at position {} of the ring over ranks {:?}",
                self.rank(),
                self.position,
                self.ranks
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_ranks_not_positions() -> Result<()> {
        let place = RingPlace::new(1, vec![2, 5])?;
        assert_eq!(
            (place.rank(), place.rank_at(place.left()), place.world_size()),
            (5, 2, 2)
        );
        assert_eq!(place.to_string(), "rank 5 at position 1 of the ring over ranks [2, 5]");
        assert_eq!(RingPlace::identity(1, 3).to_string(), "rank 1 of 3");
        assert!(RingPlace::new(2, vec![2, 5]).is_err());
        Ok(())
    }
}
