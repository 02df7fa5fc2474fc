//! Row storage of a sparse table: fixed-size pages of equal-length rows.
//!
//! Pages rather than one growing `Vec`: a `Vec` doubles, so at times half of
//! its capacity is empty and, while it copies, it needs three times its
//! contents; a new page costs only itself and rows never move.

use std::mem::size_of;

use anyhow::bail;

/// Rows per page: small enough that the last, partly used page wastes under
/// 2% at a million rows, large enough that the page list stays short.
pub const PAGE_ROWS: usize = 1 << 14;

/// Rows of `stride` floats addressed by slot; slots count up from 0 and are
/// never freed.
pub(crate) struct RowPages {
    stride: usize,
    pages: Vec<Box<[f32]>>,
    len: usize,
}

impl RowPages {
    /// Empty storage for rows of `stride` floats.
    pub(crate) fn new(stride: usize) -> Self {
        Self {
            stride,
            pages: Vec::new(),
            len: 0,
        }
    }

    /// Floats per row.
    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// Adds a row of zeros and returns its slot.
    pub(crate) fn push(&mut self) -> anyhow::Result<u32> {
        let Ok(slot) = u32::try_from(self.len) else {
            bail!("a table shard holds at most {} rows", u64::from(u32::MAX) + 1);
        };
        if self.len == self.pages.len() * PAGE_ROWS {
            // Zeroed allocations come from calloc: untouched rows cost no RAM.
            self.pages.push(vec![0.0; PAGE_ROWS * self.stride].into_boxed_slice());
        }
        self.len += 1;
        Ok(slot)
    }

    /// The row in `slot`.
    pub(crate) fn row(&self, slot: u32) -> &[f32] {
        let (page, start) = self.locate(slot);
        &self.pages[page][start..start + self.stride]
    }

    /// The row in `slot`, writable.
    pub(crate) fn row_mut(&mut self, slot: u32) -> &mut [f32] {
        let (page, start) = self.locate(slot);
        &mut self.pages[page][start..start + self.stride]
    }

    /// Bytes allocated: whole pages, used or not, and the page list.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.pages.len() * PAGE_ROWS * self.stride * size_of::<f32>() + self.pages.capacity() * size_of::<Box<[f32]>>()
    }

    fn locate(&self, slot: u32) -> (usize, usize) {
        let slot = slot as usize;
        (slot / PAGE_ROWS, slot % PAGE_ROWS * self.stride)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_stay_apart_across_pages() -> anyhow::Result<()> {
        let mut pages = RowPages::new(3);
        let count = PAGE_ROWS + 5;
        for i in 0..count {
            let slot = pages.push()?;
            assert_eq!(slot as usize, i);
            assert_eq!(pages.row(slot), [0.0; 3]);
            pages.row_mut(slot).fill(i as f32);
        }
        for slot in [0, PAGE_ROWS as u32 - 1, PAGE_ROWS as u32, count as u32 - 1] {
            assert_eq!(pages.row(slot), [slot as f32; 3]);
        }
        assert_eq!(pages.pages.len(), 2);
        assert!(pages.memory_bytes() >= 2 * PAGE_ROWS * 3 * 4);
        Ok(())
    }
}
