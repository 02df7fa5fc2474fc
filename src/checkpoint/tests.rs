//! Tests of `checkpoint`.

use super::*;

fn store_with_steps(root: &Path, steps: &[usize]) -> Result<CheckpointStore> {
    let store = CheckpointStore::new(root, 2);
    for &step in steps {
        let a = store.write(step, "a.bin", &vec![step as u8; 1000])?;
        let b = store.write(step, "b.bin", b"second role")?;
        store.commit(step, 2, vec![a, b])?;
    }
    Ok(store)
}

#[test]
fn newest_valid_checkpoint_is_found_and_old_ones_pruned() -> Result<()> {
    let root = tempfile::tempdir()?;
    let store = store_with_steps(root.path(), &[5, 10, 15])?;
    assert_eq!(store.steps()?, vec![10, 15], "keep = 2");
    let latest = store.latest()?.expect("a checkpoint");
    assert_eq!(latest.step, 15);
    assert_eq!(latest.read("a.bin")?, vec![15u8; 1000]);
    latest.check_world_size(2)?;
    assert!(latest.check_world_size(3).is_err());
    assert!(latest.read("c.bin").is_err());
    assert!(!latest.dir.join(".a.bin.tmp").exists());
    Ok(())
}

#[test]
fn truncated_corrupted_and_uncommitted_checkpoints_are_skipped() -> Result<()> {
    let root = tempfile::tempdir()?;
    let mut store = store_with_steps(root.path(), &[5, 10])?;
    store.keep = 10;
    let file = store.step_dir(10).join("a.bin");
    let mut bytes = fs::read(&file)?;
    bytes[500] ^= 0x01;
    fs::write(&file, &bytes)?;
    assert_eq!(store.latest()?.expect("step 5 is intact").step, 5);

    fs::write(&file, &bytes[..999])?;
    assert_eq!(store.latest()?.expect("step 5 is intact").step, 5);

    // A role died before step 20 was committed: files without a manifest.
    store.write(20, "a.bin", b"half of a checkpoint")?;
    assert_eq!(store.latest()?.expect("step 5 is intact").step, 5);

    fs::write(store.step_dir(5).join("b.bin"), b"second rolf")?;
    assert!(store.latest()?.is_none(), "nothing intact is left");
    Ok(())
}

#[test]
fn a_manifest_listing_no_files_is_skipped_for_the_one_before() -> Result<()> {
    let root = tempfile::tempdir()?;
    let store = store_with_steps(root.path(), &[5, 10])?;
    let empty = Manifest {
        format: FORMAT.to_string(),
        step: 10,
        world_size: 2,
        files: Vec::new(),
    };
    let manifest = store.step_dir(10).join(MANIFEST);
    fs::write(&manifest, serde_json::to_vec(&empty)?)?;
    let err = format!("{:#}", store.verify(10).unwrap_err());
    assert!(err.contains(&format!("{} lists no files", manifest.display())), "{err}");
    assert_eq!(store.latest()?.expect("step 5 is intact").step, 5);
    Ok(())
}

#[test]
fn a_commit_of_no_files_writes_no_manifest() -> Result<()> {
    let root = tempfile::tempdir()?;
    let store = CheckpointStore::new(root.path(), 2);
    let err = format!("{:#}", store.commit(10, 2, Vec::new()).unwrap_err());
    assert!(err.contains("holds no checkpoint file"), "{err}");
    // A node whose disk holds none of the files the coordinator recorded: nothing to commit.
    let elsewhere = HeldFile {
        record: FileRecord {
            name: "stage-1.bin".into(),
            bytes: 64,
            crc32c: 1,
        },
        nodes: vec!["10.0.0.2".into()],
    };
    let record = CommitRecord {
        step: 10,
        world_size: 2,
        files: vec![elsewhere],
    };
    assert!(store.commit_held(&record).is_err());
    assert!(!store.step_dir(10).join(MANIFEST).exists());
    assert!(store.latest()?.is_none());
    Ok(())
}

#[test]
fn a_malformed_file_with_a_valid_checksum_falls_back_naming_the_file() -> Result<()> {
    let root = tempfile::tempdir()?;
    let store = CheckpointStore::new(root.path(), 3);
    let t = Tensor::new(&[1.0f32, 2.0], &Device::Cpu)?;
    for step in [5, 10] {
        let record = store.write_with(step, "replica.safetensors", |out| {
            write_tensors(out, &[("w".to_string(), t.clone())], HashMap::new())
        })?;
        store.commit(step, 1, vec![record])?;
    }
    // A faulty writer: a header length far past the file, checksummed as written.
    let record = store.write(15, "replica.safetensors", &u64::MAX.to_le_bytes())?;
    store.commit(15, 1, vec![record])?;
    let bad = store.step_dir(15).join("replica.safetensors");
    let err = format!("{:#}", store.verify(15).unwrap_err());
    assert!(err.contains(&format!("{} is malformed", bad.display())), "{err}");
    assert!(err.contains("header claims"), "{err}");
    assert_eq!(store.latest()?.expect("step 10 is intact").step, 10);
    Ok(())
}

#[test]
fn only_plain_names_inside_the_step_directory_name_checkpoint_files() {
    for name in [
        "replica.safetensors",
        "stage-1.safetensors",
        "ps-trainer-0.safetensors",
        "a..b",
    ] {
        assert!(check_file_name(name).is_ok(), "{name}");
    }
    for name in [
        "",
        ".",
        "..",
        "/dev/zero",
        "/etc/passwd",
        "../../../etc/passwd",
        "sub/file",
        "sub\\file",
        ".a.bin.tmp",
        "name with spaces",
        MANIFEST,
    ] {
        let error = check_file_name(name).unwrap_err().to_string();
        assert!(
            error.contains(&format!("{name:?} is not a plain checkpoint file name")),
            "{error}"
        );
    }
}

/// Rewrites step `step`'s manifest with its first file named `name`.
fn rename_in_manifest(store: &CheckpointStore, step: usize, name: &str) -> Result<PathBuf> {
    let path = store.step_dir(step).join(MANIFEST);
    let mut manifest: Manifest = serde_json::from_slice(&fs::read(&path)?)?;
    manifest.files[0].name = name.to_string();
    fs::write(&path, serde_json::to_vec(&manifest)?)?;
    Ok(store.step_dir(step))
}

#[test]
fn a_manifest_naming_a_path_is_refused_naming_the_entry_and_falls_back() -> Result<()> {
    let root = tempfile::tempdir()?;
    let mut store = store_with_steps(root.path(), &[5, 10])?;
    store.keep = 10;
    for name in ["/dev/zero", "/etc/passwd", "../../../../../../../../etc/passwd"] {
        let dir = rename_in_manifest(&store, 10, name)?;
        let error = format!("{:#}", store.verify(10).unwrap_err());
        assert!(error.contains(&dir.display().to_string()), "{error}");
        assert!(
            error.contains(&format!("{name:?} is not a plain checkpoint file name")),
            "{error}"
        );
        assert_eq!(store.latest()?.expect("step 5 is intact").step, 5);
    }
    Ok(())
}

#[test]
fn only_regular_files_of_the_recorded_length_are_read() -> Result<()> {
    let root = tempfile::tempdir()?;
    let mut store = store_with_steps(root.path(), &[5, 10])?;
    store.keep = 10;
    let file = store.step_dir(10).join("a.bin");
    // A symbolic link out of the directory, whatever its target holds.
    fs::remove_file(&file)?;
    std::os::unix::fs::symlink(store.step_dir(5).join("a.bin"), &file)?;
    let error = format!("{:#}", store.verify(10).unwrap_err());
    assert!(error.contains("is a symbolic link"), "{error}");
    // A FIFO: opening it for reading would wait for a writer forever.
    fs::remove_file(&file)?;
    assert!(std::process::Command::new("mkfifo").arg(&file).status()?.success());
    let error = format!("{:#}", store.verify(10).unwrap_err());
    assert!(error.contains("is not a regular file"), "{error}");
    // A file grown past its record after it was checked is not read to its end.
    fs::remove_file(&file)?;
    fs::write(&file, vec![10u8; 1000])?;
    let checkpoint = store.verify(10)?;
    fs::write(&file, vec![10u8; 5000])?;
    let error = format!("{:#}", checkpoint.read("a.bin").unwrap_err());
    assert!(error.contains("5000 bytes, the manifest says 1000"), "{error}");
    assert_eq!(store.latest()?.expect("step 5 is intact").step, 5);
    Ok(())
}

#[test]
fn a_checkpoint_holding_a_value_that_is_not_finite_is_refused_naming_the_tensor() -> Result<()> {
    let root = tempfile::tempdir()?;
    let store = CheckpointStore::new(root.path(), 3);
    for (step, poison) in [(5, 0.5), (10, f32::NAN), (15, f32::INFINITY)] {
        let w = Tensor::new(&[1.0f32, poison, 3.0], &Device::Cpu)?;
        let state = Tensor::new(&[0.5f32; 3], &Device::Cpu)?;
        let (tensors, poisoned) = match step {
            15 => (
                vec![("w".to_string(), state), ("optimizer.w.m".to_string(), w)],
                "optimizer.w.m",
            ),
            _ => (vec![("w".to_string(), w), ("optimizer.w.m".to_string(), state)], "w"),
        };
        let record = store.write_with(step, "replica.safetensors", |out| {
            write_tensors(out, &tensors, HashMap::new())
        })?;
        store.commit(step, 1, vec![record])?;
        if step > 5 {
            let error = format!("{:#}", store.verify(step).unwrap_err());
            let value = if poison.is_nan() { "NaN" } else { "inf" };
            assert!(
                error.contains(&format!("step {step}: tensor {poisoned} of"))
                    && error.contains(&format!("holds {value} (element 1)")),
                "{error}"
            );
        }
    }
    assert_eq!(store.latest()?.expect("step 5 is finite").step, 5);
    Ok(())
}

#[test]
fn a_commit_needs_every_file_written_in_full() -> Result<()> {
    let root = tempfile::tempdir()?;
    let store = CheckpointStore::new(root.path(), 3);
    let mut record = store.write(1, "a.bin", b"abc")?;
    record.bytes = 4;
    let err = store.commit(1, 1, vec![record.clone()]).unwrap_err().to_string();
    assert!(err.contains("3 bytes on disk"), "{err}");
    record.name = "missing.bin".into();
    assert!(store.commit(1, 1, vec![record]).is_err());
    assert!(store.write(1, MANIFEST, b"{}").is_err());
    assert!(store.write(1, "../escape", b"").is_err());
    assert!(store.latest()?.is_none());
    Ok(())
}

#[test]
fn tensors_and_metadata_survive_encoding() -> Result<()> {
    let t = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu)?;
    let mut bytes = Vec::new();
    write_tensors(
        &mut bytes,
        &[("w".to_string(), t.clone()), ("b".to_string(), t.sum_keepdim(1)?)],
        HashMap::from([("optimizer".to_string(), "sgd".to_string())]),
    )?;
    let (tensors, metadata) = decode_tensors(&bytes, &Device::Cpu)?;
    assert_eq!(tensors["w"].to_vec2::<f32>()?, t.to_vec2::<f32>()?);
    assert_eq!(tensors["b"].to_vec2::<f32>()?, vec![vec![3.0], vec![7.0]]);
    assert_eq!(metadata["optimizer"], "sgd");
    Ok(())
}

#[test]
fn one_state_encodes_to_the_same_bytes_whatever_the_hash_order() -> Result<()> {
    let t = Tensor::new(&[1.0f32, 2.0], &Device::Cpu)?;
    let encode = || -> Result<Vec<u8>> {
        let metadata: HashMap<String, String> = (0..32).map(|i| (format!("key{i}"), i.to_string())).collect();
        let mut bytes = Vec::new();
        write_tensors(&mut bytes, &[("w".to_string(), t.clone())], metadata)?;
        Ok(bytes)
    };
    let first = encode()?;
    for _ in 0..8 {
        assert!(encode()? == first, "two encodings of one state differ");
    }
    Ok(())
}

#[test]
fn a_node_commits_the_files_of_a_record_it_holds() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::new(dir.path(), 2);
    let held = |record: FileRecord, node: &str| HeldFile {
        record,
        nodes: vec![node.to_string()],
    };
    let here = store.write(10, "stage-0.bin", b"stage 0's state")?;
    let elsewhere = FileRecord {
        name: "stage-1.bin".into(),
        bytes: 64,
        crc32c: 1,
    };
    let record = CommitRecord {
        step: 10,
        world_size: 4,
        files: vec![held(here.clone(), "10.0.0.1"), held(elsewhere, "10.0.0.2")],
    };
    store.commit_held(&record)?;
    let checkpoint = store.verify(10)?;
    assert_eq!(checkpoint.files, vec![here]);
    let error = checkpoint.read("stage-1.bin").unwrap_err().to_string();
    assert!(error.contains("has no file stage-1.bin"), "{error}");
    Ok(())
}

#[test]
fn the_coordinators_record_of_a_node_local_commit_survives_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::new(dir.path().join("checkpoints"), 2);
    assert_eq!(store.recorded()?, None);
    let record = CommitRecord {
        step: 20,
        world_size: 3,
        files: vec![HeldFile {
            record: FileRecord {
                name: "replica.safetensors".into(),
                bytes: 8,
                crc32c: 7,
            },
            nodes: vec!["10.0.0.1".into(), "10.0.0.2".into()],
        }],
    };
    store.record(&record)?;
    assert_eq!(CheckpointStore::new(store.root(), 2).recorded()?, Some(record));
    std::fs::write(store.root().join(COMMIT_RECORD), b"{")?;
    let error = store.recorded().unwrap_err().to_string();
    assert!(error.contains("committed.json is malformed"), "{error}");
    Ok(())
}
