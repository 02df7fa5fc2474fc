//! What the roles of a job take of this host's limits on threads, open files and memory maps,
//! counted from the config before anything starts, so that `cluster.nproc_per_node = 100000` is
//! an error naming the key and the limit instead of a thread that cannot be spawned and a
//! process that aborts.
//!
//! The counts are lower bounds, measured on jobs whose roles one process holds (`flotilla
//! train`), whose per-process limits (open files, memory maps) they are checked against: a rank
//! of a collective job runs two threads (its device actor and its communication worker), a
//! parameter-server trainer one (its device actor), a shard one (its actor's arbiter) with four
//! open files (that arbiter's event loop and its socket); every thread maps four regions (its
//! stack and its signal stack, each behind a guard page). A launched node spreads the same roles
//! over processes of their own, each with more threads.

use super::{FieldError, JobConfig};

/// Memory maps of one thread: its stack and its signal stack, each behind a guard page.
const THREAD_MAPS: u64 = 4;

/// What one rank and one parameter-server shard hold of a resource the host limits.
#[derive(Debug, Clone, Copy)]
struct Cost {
    /// The resource, in the plural.
    what: &'static str,
    /// A rank of a collective job (data parallel or pipeline).
    rank: u64,
    /// A trainer of a parameter-server job.
    trainer: u64,
    /// A parameter-server shard.
    shard: u64,
}

/// Threads: a role's own, beside the pools every role of a process shares.
const THREADS: Cost = Cost {
    what: "threads",
    rank: 2,
    trainer: 1,
    shard: 1,
};

/// Open files: a shard's event loop and socket; ranks in one process hold none of their own.
const OPEN_FILES: Cost = Cost {
    what: "open files",
    rank: 0,
    trainer: 0,
    shard: 4,
};

/// Memory maps: those of a role's threads.
const MEMORY_MAPS: Cost = Cost {
    what: "memory maps",
    rank: 2 * THREAD_MAPS,
    trainer: THREAD_MAPS,
    shard: THREAD_MAPS,
};

/// A limit of this host: the most it allows, and which setting says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limit {
    /// The most it allows.
    pub(super) value: u64,
    /// The setting, as a user changes it (`ulimit -n`, `kernel.pid_max`).
    pub(super) name: &'static str,
}

/// The limits the roles of a job count against; `None` where one cannot be read, and so is not
/// checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct HostLimits {
    /// Threads on this host: the lowest of the kernel's thread and pid limits and, for a user
    /// other than root, `ulimit -u`.
    pub(super) threads: Option<Limit>,
    /// Open files of one process (`ulimit -n`, the soft limit).
    pub(super) open_files: Option<Limit>,
    /// Memory maps of one process (`vm.max_map_count`).
    pub(super) memory_maps: Option<Limit>,
}

impl HostLimits {
    /// This host's limits, from `/proc`.
    pub(super) fn of_this_host() -> Self {
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let sysctl = |name: &'static str| {
            let path = format!("/proc/sys/{}", name.replace('.', "/"));
            let value = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
            Some(Limit { value, name })
        };
        let rlimit = |row: &str, name: &'static str| {
            Some(Limit {
                value: soft_limit(&limits, row)?,
                name,
            })
        };
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        // The kernel does not hold root to `ulimit -u`.
        let user_processes = rlimit("Max processes", "ulimit -u").filter(|_| !root);
        let threads = [sysctl("kernel.threads-max"), sysctl("kernel.pid_max"), user_processes]
            .into_iter()
            .flatten()
            .min_by_key(|limit| limit.value);
        Self {
            threads,
            open_files: rlimit("Max open files", "ulimit -n"),
            memory_maps: sysctl("vm.max_map_count"),
        }
    }
}

/// The soft limit of the row of `/proc/self/limits` whose name is `row`; `None` when unlimited
/// or not there.
fn soft_limit(limits: &str, row: &str) -> Option<u64> {
    let line = limits.lines().find(|line| line.starts_with(row))?;
    line[row.len()..].split_whitespace().next()?.parse().ok()
}

/// Refuses `config` when the roles of one node need more threads, open files or memory maps
/// than `host` allows; the error names the key of the larger share and the limit.
pub(super) fn check(config: &JobConfig, host: &HostLimits) -> Result<(), FieldError> {
    let ranks = config.cluster.nproc_per_node as u128;
    let shards = config.cluster.server_num as u128;
    let parameter_server = config.cluster.is_parameter_server();
    for (cost, limit) in [
        (THREADS, host.threads),
        (OPEN_FILES, host.open_files),
        (MEMORY_MAPS, host.memory_maps),
    ] {
        let Some(limit) = limit else {
            continue;
        };
        let per_rank = match parameter_server {
            true => cost.trainer,
            false => cost.rank,
        };
        let (of_ranks, of_shards) = (ranks * u128::from(per_rank), shards * u128::from(cost.shard));
        let need = of_ranks + of_shards;
        if need <= u128::from(limit.value) {
            continue;
        }
        let key = match of_ranks >= of_shards {
            true => "cluster.nproc_per_node",
            false => "cluster.server_num",
        };
        let shares = match parameter_server {
            true => format!("{ranks} trainers × {per_rank} + {shards} shards × {}", cost.shard),
            false => format!("{ranks} ranks × {per_rank}"),
        };
        return Err(FieldError::new(
            key,
            format!(
                "the roles of one node need at least {need} {} ({shares}), more than the {} this host allows ({})",
                cost.what, limit.value, limit.name
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL_HOST: HostLimits = HostLimits {
        threads: Some(Limit {
            value: 32768,
            name: "kernel.pid_max",
        }),
        open_files: Some(Limit {
            value: 1024,
            name: "ulimit -n",
        }),
        memory_maps: Some(Limit {
            value: 65530,
            name: "vm.max_map_count",
        }),
    };

    /// The default job changed by `edit`, unvalidated.
    fn job(edit: impl FnOnce(&mut JobConfig)) -> JobConfig {
        let mut config = JobConfig::default();
        edit(&mut config);
        config
    }

    /// `key: message` of the refusal of `config` on [`SMALL_HOST`].
    fn refusal(config: &JobConfig) -> String {
        let err = check(config, &SMALL_HOST).unwrap_err();
        format!("{}: {}", err.key, err.message)
    }

    #[test]
    fn jobs_of_a_node_s_size_fit() {
        check(&JobConfig::default(), &SMALL_HOST).unwrap();
        check(&job(|c| c.cluster.nproc_per_node = 8000), &SMALL_HOST).unwrap();
        check(&job(|c| c.cluster.server_num = 200), &SMALL_HOST).unwrap();
        let unknown = HostLimits::default();
        check(&job(|c| c.cluster.nproc_per_node = usize::MAX), &unknown).unwrap();
    }

    #[test]
    fn too_many_ranks_are_refused_naming_the_key_and_the_limit() {
        let msg = refusal(&job(|c| c.cluster.nproc_per_node = 100_000));
        assert_eq!(
            msg,
            "cluster.nproc_per_node: the roles of one node need at least 200000 threads (100000 ranks × 2), \
             more than the 32768 this host allows (kernel.pid_max)"
        );
        // Within the threads, past the memory maps.
        let msg = refusal(&job(|c| c.cluster.nproc_per_node = 9000));
        assert!(
            msg.starts_with("cluster.nproc_per_node: the roles of one node need at least 72000 memory maps")
                && msg.contains("more than the 65530 this host allows (vm.max_map_count)"),
            "{msg}"
        );
        // No overflow at the type's end.
        let msg = refusal(&job(|c| c.cluster.nproc_per_node = usize::MAX));
        assert!(msg.contains(&format!("{} threads", 2 * u128::from(u64::MAX))), "{msg}");
    }

    #[test]
    fn too_many_shards_are_refused_naming_the_key_and_the_limit() {
        let msg = refusal(&job(|c| c.cluster.server_num = 100_000));
        assert!(
            msg.starts_with("cluster.server_num: the roles of one node need at least 100002 threads (2 trainers × 1 + 100000 shards × 1)"),
            "{msg}"
        );
        let msg = refusal(&job(|c| c.cluster.server_num = 300));
        assert_eq!(
            msg,
            "cluster.server_num: the roles of one node need at least 1200 open files (2 trainers × 0 + 300 shards × 4), \
             more than the 1024 this host allows (ulimit -n)"
        );
    }

    #[test]
    fn soft_limits_are_read_from_proc_self_limits() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             96367                96367                processes \n\
                      Max open files            1024                 20000                files     \n\
                      Max locked memory         unlimited            unlimited            bytes     \n";
        assert_eq!(soft_limit(limits, "Max open files"), Some(1024));
        assert_eq!(soft_limit(limits, "Max processes"), Some(96367));
        assert_eq!(soft_limit(limits, "Max locked memory"), None);
        assert_eq!(soft_limit(limits, "Max pending signals"), None);
    }
}
