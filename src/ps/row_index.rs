//! The index of a sparse table: feature id → slot of its row in the pages.

use std::collections::hash_map::Entry;
use std::hash::{Hash, Hasher};
use std::mem::size_of;

use rustc_hash::FxHashMap;

/// A feature id kept as two `u32` halves: alignment 4 makes the map's
/// `(key, slot)` entries 12 bytes instead of the 16 a `u64` key pads them
/// to, a quarter of the index's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowKey([u32; 2]);

impl RowKey {
    fn new(id: u64) -> Self {
        Self([id as u32, (id >> 32) as u32])
    }

    fn id(self) -> u64 {
        u64::from(self.0[0]) | (u64::from(self.0[1]) << 32)
    }
}

impl Hash for RowKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.id());
    }
}

/// Control bytes hashbrown (std's map) adds past the buckets: one SIMD group.
const GROUP_WIDTH: usize = 16;

/// Maps feature ids to row slots; one hash per lookup, nothing allocated per
/// row.
#[derive(Default)]
pub(crate) struct RowIndex {
    map: FxHashMap<RowKey, u32>,
}

impl RowIndex {
    /// The slot of `id`, or the one `create` makes for it (and indexes).
    pub(crate) fn get_or_insert_with(
        &mut self,
        id: u64,
        create: impl FnOnce() -> anyhow::Result<u32>,
    ) -> anyhow::Result<u32> {
        match self.map.entry(RowKey::new(id)) {
            Entry::Occupied(entry) => Ok(*entry.get()),
            Entry::Vacant(entry) => Ok(*entry.insert(create()?)),
        }
    }

    /// The slot of `id`, if it has one.
    pub(crate) fn get(&self, id: u64) -> Option<u32> {
        self.map.get(&RowKey::new(id)).copied()
    }

    /// Forgets `id`; returns the slot it had.
    pub(crate) fn remove(&mut self, id: u64) -> Option<u32> {
        self.map.remove(&RowKey::new(id))
    }

    /// Every `(id, slot)`, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.map.iter().map(|(key, &slot)| (key.id(), slot))
    }

    /// Bytes the map has allocated, from hashbrown's layout: a power of two
    /// of buckets (7/8 of them usable), each an entry plus a control byte.
    pub(crate) fn memory_bytes(&self) -> usize {
        let capacity = self.map.capacity();
        let buckets = match capacity {
            0 => return 0,
            1..=7 => capacity + 1,
            _ => capacity / 7 * 8,
        };
        bucket_bytes(buckets)
    }

    /// Bytes of a map allocated for `entries` entries (as hashbrown sizes it).
    pub(crate) fn bytes_for(entries: usize) -> usize {
        let buckets = match entries {
            0 => return 0,
            1..=3 => 4,
            4..=7 => 8,
            _ => (entries * 8).div_ceil(7).next_power_of_two(),
        };
        bucket_bytes(buckets)
    }
}

/// Bytes of `buckets` entries with their control bytes.
fn bucket_bytes(buckets: usize) -> usize {
    let entries = (buckets * size_of::<(RowKey, u32)>()).next_multiple_of(GROUP_WIDTH);
    entries + buckets + GROUP_WIDTH
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_entries_are_twelve_bytes() {
        for id in [0, 1, u64::from(u32::MAX), 1 << 32, u64::MAX, 0x0123_4567_89AB_CDEF] {
            assert_eq!(RowKey::new(id).id(), id);
        }
        assert_eq!(size_of::<(RowKey, u32)>(), 12);
    }

    #[test]
    fn finds_what_it_inserted_and_creates_once() -> anyhow::Result<()> {
        let mut index = RowIndex::default();
        let mut created = 0u32;
        for id in [5u64, 1 << 40, 5, u64::MAX, 1 << 40] {
            index.get_or_insert_with(id, || {
                created += 1;
                Ok(created - 1)
            })?;
        }
        assert_eq!(created, 3);
        let mut pairs: Vec<(u64, u32)> = index.iter().collect();
        pairs.sort_unstable();
        assert_eq!(pairs, [(5, 0), (1 << 40, 1), (u64::MAX, 2)]);
        Ok(())
    }

    #[test]
    fn memory_grows_in_power_of_two_buckets() -> anyhow::Result<()> {
        let mut index = RowIndex::default();
        assert_eq!(index.memory_bytes(), 0);
        for id in 0..1000u64 {
            index.get_or_insert_with(id, || Ok(id as u32))?;
        }
        // 1000 ids need 1000·8/7 → 2048 buckets of 12 + 1 bytes.
        assert_eq!(index.memory_bytes(), 2048 * 13 + GROUP_WIDTH);
        assert_eq!(RowIndex::bytes_for(1000), index.memory_bytes());
        assert_eq!(index.remove(7), Some(7));
        assert_eq!((index.get(7), index.get(8)), (None, Some(8)));
        Ok(())
    }
}
