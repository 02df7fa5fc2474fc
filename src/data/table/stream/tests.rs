//! Tests of `stream`.

use super::*;
use crate::data::{Batch, DataPosition, Inputs, RankBatches, RowSource, Targets};

use super::parquet_files;
use crate::data::table::tests::{LINE_ERRORS, REGRESS};

const ROWS: usize = 101;

/// Row `i`: features `i` and `-i`, label `i / 2` — each row its own.
fn row(i: usize) -> Vec<f32> {
    vec![i as f32, -(i as f32), i as f32 / 2.0]
}

/// The same `ROWS` rows as one CSV file (a header, a blank line and a text column the model
/// does not read), one Parquet file of row groups of 10, one safetensors file (`a` as f64,
/// `b` as i32, `y` as f32) and a directory of `.npy` files (`a` as f16: its values are
/// whole numbers it holds exactly), in `dir`.
fn tables(dir: &Path) -> Result<[(TableFormat, String); 4]> {
    let mut text = String::from("a,note,b,y\n");
    for i in 0..ROWS {
        let [a, b, y] = row(i)[..] else { unreachable!() };
        text += &format!("{a},\"see, {i}\",{b},{y}\n");
        if i == 40 {
            text += "\n";
        }
    }
    let csv = dir.join("t.csv");
    std::fs::write(&csv, text)?;
    let parquet = dir.join("t.parquet");
    let column = |k: usize| parquet_files::Column::Doubles((0..ROWS).map(|i| f64::from(row(i)[k])).collect());
    parquet_files::write_parquet(&parquet, &[("y", column(2)), ("a", column(0)), ("b", column(1))], 10);
    use candle_core::{DType, Device, Tensor};
    let values = |k: usize| (0..ROWS).map(|i| row(i)[k]).collect::<Vec<f32>>();
    let array = |k: usize, dtype: DType| Tensor::from_vec(values(k), ROWS, &Device::Cpu)?.to_dtype(dtype);
    let safetensors = dir.join("t.safetensors");
    let named = std::collections::HashMap::from([
        ("a".to_string(), array(0, DType::F64)?),
        ("b".to_string(), array(1, DType::I64)?),
        ("y".to_string(), array(2, DType::F32)?),
    ]);
    candle_core::safetensors::save(&named, &safetensors)?;
    let npy = dir.join("t_npy");
    std::fs::create_dir(&npy)?;
    array(0, DType::F16)?.write_npy(npy.join("a.npy"))?;
    array(1, DType::F32)?.write_npy(npy.join("b.npy"))?;
    array(2, DType::F32)?.write_npy(npy.join("y.npy"))?;
    let name = |path: PathBuf| path.to_string_lossy().into_owned();
    Ok([
        (TableFormat::Csv, name(csv)),
        (TableFormat::Parquet, name(parquet)),
        (TableFormat::Arrays, name(safetensors)),
        (TableFormat::Arrays, name(npy)),
    ])
}

/// The rows of `batches`, one after the other: their features and their values.
fn joined<'a>(batches: impl IntoIterator<Item = &'a Batch>) -> (Vec<f32>, Vec<f32>) {
    let (mut features, mut values) = (Vec::new(), Vec::new());
    for batch in batches {
        let (Inputs::Features(x), Targets::Values(y)) = (&batch.inputs, &batch.targets) else {
            panic!("the test tables regress values from features: {batch:?}");
        };
        features.extend(x);
        values.extend(y);
    }
    (features, values)
}

fn layout(parts: usize, shuffle_buffer: usize) -> DataLayout {
    DataLayout {
        parts,
        shuffle_buffer,
        seed: 3,
    }
}

/// Features `a` and `b`, label `y`.
fn columns(features: &[String]) -> Columns<'_> {
    Columns {
        features: Some(features),
        ..REGRESS
    }
}

fn a_b() -> Vec<String> {
    vec!["a".to_string(), "b".to_string()]
}

#[test]
fn every_row_is_in_exactly_one_part_in_file_order() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let a_b = a_b();
    for (format, file) in tables(dir.path())? {
        for parts in [1, 2, 3, 4] {
            let table = StreamedTable::open(
                format,
                std::slice::from_ref(&file),
                columns(&a_b),
                layout(parts, 0),
                "t",
            )?;
            assert_eq!((table.rows, table.dim), (ROWS as u64, 2), "{format:?}");
            let mut loader = table.loader(12, 0, 1)?;
            let mut rows = Vec::new();
            while let Some(batch) = loader.next_eval_batch()? {
                rows.extend(batch);
            }
            assert_eq!(
                rows,
                (0..ROWS).map(row).collect::<Vec<_>>(),
                "{format:?}, {parts} parts"
            );
        }
    }
    Ok(())
}

#[test]
fn ranks_read_their_own_parts_and_their_batches_concatenate_to_one_process_s() -> Result<()> {
    let dir = tempfile::tempdir()?;
    for (format, file) in tables(dir.path())? {
        let table = Arc::new(StreamedTable::open(
            format,
            &[file],
            columns(&a_b()),
            layout(2, 7),
            "t",
        )?);
        let rows = RowSource::Streamed(table);
        let mut whole = RankBatches::new(&rows, 12, (0, 1), 0, 0)?;
        let expected: Vec<Batch> = (0..20).map(|step| whole.batch(step)).collect::<Result<_>>()?;
        for world in [2, 4] {
            let mut ranks: Vec<RankBatches> = (0..world)
                .map(|rank| RankBatches::new(&rows, 12, (rank, world), 0, 0))
                .collect::<Result<_>>()?;
            for (step, batch) in expected.iter().enumerate() {
                let slices: Vec<Batch> = ranks.iter_mut().map(|rank| rank.batch(step)).collect::<Result<_>>()?;
                let what = format!("{format:?}, {world} ranks, step {step}");
                assert_eq!(joined(&slices), joined([batch]), "{what}");
            }
            if world == 2 {
                let read: Vec<u64> = ranks
                    .iter()
                    .map(|rank| match rank {
                        RankBatches::Streamed { loader, .. } => loader.records_read(),
                        RankBatches::InMemory(_) => 0,
                    })
                    .collect();
                // 20 steps of 6 rows from a part of about 50, in windows of 7: each rank read
                // its own part two and a half times, never the other (which would double it).
                assert!(read.iter().all(|&r| (100..=150).contains(&r)), "{format:?}: {read:?}");
            }
        }
        // A rollback reads the step's batch again — from a mark where there is one, else
        // from the start; a jump ahead skips to it.
        for mark_every in [0, 4] {
            let mut rank = RankBatches::new(&rows, 12, (1, 2), 0, mark_every)?;
            let read: Vec<Batch> = (0..14).map(|step| rank.batch(step)).collect::<Result<_>>()?;
            let marked: Vec<usize> = match &rank {
                RankBatches::Streamed { marks, .. } => marks.iter().map(|(step, _)| *step).collect(),
                RankBatches::InMemory(_) => Vec::new(),
            };
            assert_eq!(marked, if mark_every == 0 { vec![] } else { vec![0, 4, 8, 12] });
            for back in [9, 8, 2] {
                let mut fresh = RankBatches::new(&rows, 12, (1, 2), 0, 0)?;
                let what = format!("back to {back}, marks every {mark_every}");
                assert_eq!(rank.batch(back)?, fresh.batch(back)?, "{what}");
                assert_eq!(rank.batch(back + 1)?, fresh.batch(back + 1)?, "{what}");
            }
            assert_eq!(rank.batch(13)?, read[13]);
        }
    }
    Ok(())
}

#[test]
fn ranks_resume_at_the_joined_positions_of_a_checkpoint_without_reading_the_rows_before() -> Result<()> {
    let dir = tempfile::tempdir()?;
    for (format, file) in tables(dir.path())? {
        let open = |parts| {
            StreamedTable::open(
                format,
                std::slice::from_ref(&file),
                columns(&a_b()),
                layout(parts, 7),
                "t",
            )
        };
        let rows = RowSource::from(open(2)?);
        let mut whole = RankBatches::new(&rows, 12, (0, 1), 0, 0)?;
        let expected: Vec<Batch> = (0..20).map(|step| whole.batch(step)).collect::<Result<_>>()?;
        // Two ranks checkpoint after 11 steps, each knowing only its own part.
        let mut saved = DataPosition::default();
        for rank in 0..2 {
            let mut batches = RankBatches::new(&rows, 12, (rank, 2), 0, 0)?;
            for step in 0..11 {
                batches.batch(step)?;
            }
            saved.merge(batches.position(11)?.context("a stream has a position")?);
        }
        // Three ranks take up from there: each reads only its rows from step 11 on.
        let what = format!("{format:?}");
        let mut ranks: Vec<RankBatches> = (0..3)
            .map(|rank| RankBatches::new(&rows, 12, (rank, 3), 0, 0))
            .collect::<Result<_>>()?;
        let records_read = |rank: &RankBatches| match rank {
            RankBatches::Streamed { loader, .. } => loader.records_read(),
            RankBatches::InMemory(_) => 0,
        };
        for rank in &mut ranks {
            rank.resume_at(11, &saved)?;
        }
        let before: Vec<u64> = ranks.iter().map(records_read).collect();
        for (step, batch) in expected.iter().enumerate().skip(11) {
            let slices: Vec<Batch> = ranks.iter_mut().map(|rank| rank.batch(step)).collect::<Result<_>>()?;
            assert_eq!(joined(&slices), joined([batch]), "{what}, step {step}");
        }
        // Ranks 0 and 2 read one part each, rank 1 both (its rows straddle them): nine
        // batches of six rows from each part read, and at most a shuffle window more —
        // none of the 66 rows of a part before step 11.
        for ((rank, before), parts) in ranks.iter().zip(before).zip([1, 2, 1]) {
            let read = records_read(rank) - before;
            assert!(read <= parts * (9 * 6 + 7), "{what}: {read}");
        }
        // The position of another cut of the data is refused, and the rank reads its way.
        let other = RowSource::from(open(3)?);
        let mut elsewhere = RankBatches::new(&other, 12, (0, 1), 0, 0)?;
        let err = elsewhere.resume_at(11, &saved).unwrap_err();
        assert!(format!("{err:#}").contains("cut and shuffled as"), "{err:#}");
        let mut fresh = RankBatches::new(&other, 12, (0, 1), 0, 0)?;
        assert_eq!(elsewhere.batch(11)?, fresh.batch(11)?, "{what}");
    }
    Ok(())
}

#[test]
fn the_ranks_held_out_shares_hold_every_row_once_in_pieces() -> Result<()> {
    let dir = tempfile::tempdir()?;
    for (format, file) in tables(dir.path())? {
        let table = StreamedTable::open(format, &[file], columns(&a_b()), layout(3, 0), "t")?;
        let rows = RowSource::from(table);
        let all = Batch::of_rows(&(0..ROWS).map(row).collect::<Vec<_>>(), 2, true);
        for world in [1, 2, 3] {
            let mut pieces = Vec::new();
            for rank in 0..world {
                for piece in rows.share(rank, world, 8)? {
                    let piece = piece?;
                    assert!(piece.rows() <= 8);
                    pieces.push(piece);
                }
            }
            assert_eq!(joined(&pieces), joined([&all]), "{format:?}, {world} ranks");
        }
    }
    Ok(())
}

/// A streamed file's errors name the file's line (the header is line 1) whether its lines
/// end in `\r\n` or blank lines come before the row, as the in-memory reader's do.
#[test]
fn a_streamed_file_s_errors_name_its_lines() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("bad.csv").to_string_lossy().into_owned();
    for (text, columns, line, error) in LINE_ERRORS {
        std::fs::write(&file, text)?;
        let files = std::slice::from_ref(&file);
        let err = StreamedTable::open(TableFormat::Csv, files, columns, layout(1, 0), "t")
            .and_then(|table| {
                let mut loader = table.loader(1, 0, 1)?;
                (0..4).try_for_each(|_| loader.next_batch().map(drop))
            })
            .unwrap_err();
        let message = format!("{err:#}");
        assert!(
            message.contains(&format!("bad.csv:{line}{error}")),
            "{text:?}: {message}"
        );
    }
    Ok(())
}

#[test]
fn a_bad_cell_in_a_later_part_is_named_and_a_missing_column_fails_the_open() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut text = String::from("x,y\n");
    for i in 0..40 {
        text += &format!("{i},{}\n", if i == 30 { "oops".to_string() } else { i.to_string() });
    }
    let file = dir.path().join("bad.csv").to_string_lossy().into_owned();
    std::fs::write(&file, text)?;
    let table = StreamedTable::open(
        TableFormat::Csv,
        std::slice::from_ref(&file),
        REGRESS,
        layout(2, 0),
        "t",
    )?;
    let mut second = table.loader(4, 1, 2)?;
    let err = (0..10).try_for_each(|_| second.next_batch().map(drop)).unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("bad.csv (the part from byte") && text.contains("column \"y\": \"oops\" is not a number"),
        "{text}"
    );
    let nope = ["nope".to_string()];
    let wrong = Columns {
        features: Some(&nope),
        ..REGRESS
    };
    let text = format!(
        "{:#}",
        StreamedTable::open(TableFormat::Csv, &[file], wrong, layout(2, 0), "t").unwrap_err()
    );
    assert!(
        text.contains("bad.csv") && text.contains("no column \"nope\" (train.feature_columns)"),
        "{text}"
    );
    Ok(())
}
