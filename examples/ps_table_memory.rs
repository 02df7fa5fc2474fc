//! Memory per row and pull/push speed of a parameter-server sparse table,
//! the figures the PS shard's memory target (within 1.5× of the raw
//! id + value + state bytes at a million rows) is held against.
//!
//!     cargo run --release --example ps_table_memory              # a million rows
//!     ROWS=20000000 cargo run --release --example ps_table_memory # or as many as ROWS says
//!
//! Memory is counted by a global allocator that tallies live bytes, and
//! compared with the table's own `memory_bytes()`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use flotilla::ps::optimizer::ServerOptimizer;
use flotilla::ps::table::{Lookup, RowInit, SparseTable};
use flotilla::rng::SplitMix64;

/// The system allocator, counting the bytes currently allocated.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = System.alloc(layout);
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = System.alloc_zeroed(layout);
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = System.realloc(ptr, layout, new_size);
        if !new.is_null() {
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Rows each table grows to: `ROWS`, a million by default.
fn rows() -> usize {
    std::env::var("ROWS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000)
}
const BATCH: usize = 4096;
/// Sizes below this are dominated by the last page, not the steady state.
const WORST_FROM: usize = 100_000;

fn main() -> anyhow::Result<()> {
    let init = RowInit { seed: 1, bound: 0.01 };
    let sgd = ServerOptimizer::Sgd { lr: 0.1, momentum: 0.0 };
    let momentum = ServerOptimizer::Sgd { lr: 0.1, momentum: 0.9 };
    let adagrad = ServerOptimizer::Adagrad {
        lr: 0.1,
        epsilon: 1e-10,
        initial_accumulator: 0.1,
    };
    let adam = ServerOptimizer::Adam {
        lr: 0.001,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
    };
    let configs = [
        (9, "sgd", sgd),
        (9, "sgd-momentum", momentum),
        (9, "adagrad", adagrad),
        (9, "adam", adam),
        (1, "sgd", sgd),
        (1, "adagrad", adagrad),
        (1, "adam", adam),
    ];
    let rows = rows();
    let mut rng = SplitMix64::new(7);
    let ids: Vec<u64> = (0..rows).map(|_| rng.next_u64()).collect();
    let mut shuffled = ids.clone();
    rng.shuffle(&mut shuffled);
    let mut buffer = vec![0.5f32; BATCH * 9];

    println!(
        "{:>5} {:>13} {:>9} {:>11} {:>11} {:>9} {:>9} {:>13} {:>11} {:>11} {:>11}",
        "width",
        "optimizer",
        "raw B/row",
        "B/row@200k",
        "B/row@end",
        "ratio@end",
        "estim@end",
        "worst≥100k",
        "create/s",
        "pull/s",
        "push/s"
    );
    for (width, label, optimizer) in configs {
        let baseline = LIVE_BYTES.load(Ordering::Relaxed);
        let mut table = SparseTable::new("emb", width, init, optimizer);
        let raw = table.raw_bytes_per_row() as f64;
        let per_row = |table: &SparseTable| (LIVE_BYTES.load(Ordering::Relaxed) - baseline) as f64 / table.len() as f64;
        let (mut at_200k, mut worst) = (0.0, 0.0f64);

        let started = Instant::now();
        for chunk in ids.chunks(BATCH) {
            // Rows are created by their first push.
            table.apply_gradients(chunk, &buffer[..chunk.len() * width], &[])?;
            if table.len() >= WORST_FROM {
                worst = worst.max(per_row(&table) / raw);
            }
            if table.len() == 200_704 {
                at_200k = per_row(&table);
            }
        }
        let create_rate = rows as f64 / started.elapsed().as_secs_f64();
        let at_end = per_row(&table);
        let estimate = table.memory_bytes() as f64 / table.len() as f64;

        let started = Instant::now();
        for chunk in shuffled.chunks(BATCH) {
            table.pull(chunk, &mut buffer[..chunk.len() * width], Lookup::Training)?;
        }
        let pull_rate = rows as f64 / started.elapsed().as_secs_f64();
        let started = Instant::now();
        for chunk in shuffled.chunks(BATCH) {
            table.apply_gradients(chunk, &buffer[..chunk.len() * width], &[])?;
        }
        let push_rate = rows as f64 / started.elapsed().as_secs_f64();

        println!(
            "{width:>5} {label:>13} {raw:>9.0} {at_200k:>11.1} {at_end:>11.1} {:>9.3} {estimate:>9.1} {worst:>13.3} {:>10.2}M {:>10.2}M {:>10.2}M",
            at_end / raw,
            create_rate / 1e6,
            pull_rate / 1e6,
            push_rate / 1e6
        );
    }
    println!("(B/row counted by the allocator at {rows} rows; estim = memory_bytes()/len; worst = max ratio at any batch boundary from 100k rows on)");
    Ok(())
}
