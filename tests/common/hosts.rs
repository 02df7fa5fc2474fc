//! Machines for the tests: network namespaces, each with an address of its own on one switch (a
//! bridge in a namespace of its own), made by the test and removed when dropped. Needs root and
//! iproute2, as CI has.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `count` hosts on one network; removed on drop.
pub struct Hosts {
    /// The namespaces, host by host (`ip netns exec NAME …` runs a program on that host).
    pub names: Vec<String>,
    /// Each host's address.
    pub ips: Vec<String>,
    /// The switch's namespace.
    switch: String,
}

/// Runs `ip ARGS`, its error naming the command.
pub fn ip(args: &[&str]) -> Result<(), String> {
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

impl Hosts {
    /// `count` hosts, or `None` after saying why they cannot be made here; under CI, where
    /// they can, failing to make them fails the test ([`super::required`]).
    pub fn create_or_say_why(count: usize) -> Option<Self> {
        super::required("network namespaces (root and iproute2)", Self::create(count))
    }

    fn create(count: usize) -> Result<Self, String> {
        // Unique among the tests of this process, which run at once, and of other test binaries.
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let made = MADE.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}{made}", std::process::id());
        let mut hosts = Hosts {
            names: Vec::new(),
            ips: Vec::new(),
            switch: format!("flt{id}s"),
        };
        ip(&["netns", "add", &hosts.switch])?;
        let bridge = "br0";
        ip(&["-n", &hosts.switch, "link", "add", bridge, "type", "bridge"])?;
        ip(&["-n", &hosts.switch, "link", "set", bridge, "up"])?;
        for host in 0..count {
            let name = format!("flt{id}h{host}");
            ip(&["netns", "add", &name])?;
            // Pushed at once, so that a failure below still removes it.
            hosts.names.push(name.clone());
            // Each test's hosts are a network of their own: addresses may repeat between tests.
            let address = format!("10.233.7.{}", host + 1);
            let (inside, port) = (format!("v{id}h{host}"), format!("p{id}h{host}"));
            #[rustfmt::skip]
            ip(&["link", "add", &inside, "netns", &name, "type", "veth", "peer", "name", &port, "netns", &hosts.switch])?;
            ip(&["-n", &hosts.switch, "link", "set", &port, "master", bridge])?;
            ip(&["-n", &hosts.switch, "link", "set", &port, "up"])?;
            ip(&["-n", &name, "addr", "add", &format!("{address}/24"), "dev", &inside])?;
            ip(&["-n", &name, "link", "set", &inside, "up"])?;
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
            hosts.ips.push(address);
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in self.names.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "del", name]);
        }
    }
}
