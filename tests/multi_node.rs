//! Two nodes, one launcher each: two network namespaces joined by a veth
//! pair, made (and removed) by this test, so ranks on different "hosts"
//! rendezvous and run their ring over TCP between the namespaces' own
//! addresses. Needs root and iproute2 (as CI has); skipped, saying why,
//! elsewhere.

mod common;

use std::process::Command;

use common::{config, start_program, train_in_process};

const STEPS: &str = "train.steps=20";

/// Two namespaces with a veth pair; removed on drop.
struct TwoHosts {
    names: [String; 2],
    ips: [&'static str; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl TwoHosts {
    fn create() -> Result<Self, String> {
        let id = std::process::id();
        let hosts = TwoHosts {
            names: [format!("flt{id}a"), format!("flt{id}b")],
            ips: ["10.231.7.1", "10.231.7.2"],
        };
        let (a, b) = (&hosts.names[0], &hosts.names[1]);
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        let (va, vb) = (format!("v{id}a"), format!("v{id}b"));
        ip(&[
            "link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns", b,
        ])?;
        for (ns, dev, addr) in [(a, &va, hosts.ips[0]), (b, &vb, hosts.ips[1])] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

#[test]
fn one_launcher_per_node_trains_like_the_in_process_cluster() {
    let hosts = match TwoHosts::create() {
        Ok(hosts) => hosts,
        Err(reason) => {
            eprintln!("skipped: cannot make two network namespaces here ({reason})");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let cluster = hosts.ips.join(",");
    let launchers: Vec<_> = (0..2)
        .map(|node| {
            #[rustfmt::skip]
            let args = [
                "netns", "exec", hosts.names[node].as_str(), env!("CARGO_BIN_EXE_flotilla"),
                "launch", "--nnodes", "2", "--nproc_per_node", "1", "--node_ip", hosts.ips[node],
                "--cluster_node_ips", &cluster, "--started_port", "6170", "--", "train", "--config", "config.toml",
                "--set", STEPS, "--set", "fault_tolerance.timeout_s=30", "--run-dir", run_dir.to_str().unwrap(),
            ];
            // The nodes of one job share a token; each launcher hands it to its processes.
            start_program("ip", &args, &[("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())])
        })
        .collect();
    let finished: Vec<_> = launchers.into_iter().map(|l| l.finish(120)).collect();
    for (node, f) in finished.iter().enumerate() {
        assert!(f.success, "node {node} failed:\n{}\n{}", f.stdout, f.stderr);
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["world_size"], 2);
    assert_eq!(summary["cluster"], "multi-process");
    assert!(
        finished[0].stderr.contains("rendezvous complete"),
        "{}",
        finished[0].stderr
    );
    // Same ring, same reduction order, now over a network between hosts.
    let simulated = train_in_process(config(&[STEPS]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}
