//! Which rank this process is, as the program that started it says: our launcher and Paddle's
//! (`PADDLE_TRAINER_ID`), torchrun (`RANK`), or — for `flotilla run` started by a cluster
//! engine directly, one process per rank — Open MPI (`OMPI_COMM_WORLD_*`), MPICH's Hydra
//! (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`) or Slurm's `srun`
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_STEP_NODELIST`), whose variables
//! are read as torchrun's ([`engine_env`]): one contract inside, the engines translated at the
//! edge.

use std::collections::HashMap;

use anyhow::{anyhow, bail, ensure, Context as _, Result};

/// The ports a coordinator's port is derived in, when an engine gives none: below Linux's
/// ephemeral range, so no outgoing connection holds it by chance.
const DERIVED_PORTS: std::ops::Range<u32> = 20_000..32_768;

/// This process's rank, from `PADDLE_TRAINER_ID` or torchrun's `RANK` (which must agree when
/// both are set); `None` when neither is.
pub fn rank(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let read = |var: &str| -> Result<Option<usize>> {
        let Some(text) = env(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let rank = text
            .parse()
            .with_context(|| format!("{var} = {text:?} is not a rank"))?;
        Ok(Some(rank))
    };
    match (read("PADDLE_TRAINER_ID")?, read("RANK")?) {
        (Some(paddle), Some(torchrun)) if paddle != torchrun => {
            bail!("RANK = {torchrun} contradicts PADDLE_TRAINER_ID = {paddle}")
        }
        (Some(rank), _) | (None, Some(rank)) => Ok(Some(rank)),
        (None, None) => Ok(None),
    }
}

/// Variables only a launcher of ours, Paddle's or torchrun's sets: their presence means one
/// started this process, inside whatever engine started the launcher.
const LAUNCHER_VARS: [&str; 4] = ["PADDLE_TRAINER_ID", "RANK", "TRAINING_ROLE", "PADDLE_TRAINERS_NUM"];

/// This process's environment as its launcher or cluster engine states it: an engine's variables
/// as [`engine_env`] translates them, then the process's own.
pub fn launched_env() -> Result<impl Fn(&str) -> Option<String>> {
    let engine = engine_env(&super::process_env)?;
    Ok(move |key: &str| engine.get(key).cloned().or_else(|| super::process_env(key)))
}

/// torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT`) as the cluster engine that started this process states them, when no
/// launcher of ours, Paddle's or torchrun's did (theirs win: a launcher runs inside the
/// engine's allocation, its processes inheriting the engine's variables). Empty when no
/// engine's variables are set either.
pub fn engine_env(env: &dyn Fn(&str) -> Option<String>) -> Result<HashMap<String, String>> {
    let set = |var: &str| env(var).is_some_and(|v| !v.trim().is_empty());
    if LAUNCHER_VARS.iter().any(|var| set(var)) {
        return Ok(HashMap::new());
    }
    let engine = if set("OMPI_COMM_WORLD_RANK") {
        mpi(env, OPEN_MPI)?
    } else if set("PMI_RANK") {
        mpi(env, MPICH)?
    } else if set("SLURM_PROCID") {
        slurm(env)?
    } else {
        return Ok(HashMap::new());
    };
    Ok(engine)
}

/// The variables of one MPI implementation.
struct MpiVars {
    name: &'static str,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
    /// Variables naming the job, any of which derives the coordinator's port on one host.
    job: &'static [&'static str],
    /// Whether the ranks' parent process names the job where no variable does: MPICH's Hydra
    /// (PMI-1) keeps the job's name off the environment, and starts the ranks of one host
    /// from one proxy process.
    parent_names_job: bool,
}

const OPEN_MPI: MpiVars = MpiVars {
    name: "Open MPI",
    rank: "OMPI_COMM_WORLD_RANK",
    size: "OMPI_COMM_WORLD_SIZE",
    local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
    job: &["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"],
    parent_names_job: false,
};

const MPICH: MpiVars = MpiVars {
    name: "MPICH",
    rank: "PMI_RANK",
    size: "PMI_SIZE",
    local_rank: "MPI_LOCALRANKID",
    local_size: "MPI_LOCALNRANKS",
    job: &["PMI_KVSNAME", "PMIX_NAMESPACE"],
    parent_names_job: true,
};

/// A number variable `var` the engine must have set.
fn number(env: &dyn Fn(&str) -> Option<String>, var: &str, engine: &str) -> Result<usize> {
    let text = env(var).ok_or_else(|| anyhow!("{engine}: {var} is not set"))?;
    text.trim()
        .parse()
        .with_context(|| format!("{engine}: {var} = {text:?} is not a number"))
}

/// The rank, sizes and coordinator of a job `mpirun` started.
fn mpi(env: &dyn Fn(&str) -> Option<String>, vars: MpiVars) -> Result<HashMap<String, String>> {
    let engine = vars.name;
    let (rank, size) = (number(env, vars.rank, engine)?, number(env, vars.size, engine)?);
    ensure!(
        rank < size,
        "{engine}: {} = {rank} is outside {} = {size}",
        vars.rank,
        vars.size
    );
    let local_size = number(env, vars.local_size, engine).ok();
    let mut torchrun = HashMap::from([("RANK", rank.to_string()), ("WORLD_SIZE", size.to_string())]);
    if let Ok(local_rank) = number(env, vars.local_rank, engine) {
        torchrun.insert("LOCAL_RANK", local_rank.to_string());
    }
    if let Some(local_size) = local_size {
        torchrun.insert("LOCAL_WORLD_SIZE", local_size.to_string());
    }
    // Every rank on one host: the coordinator is there, at a port the job's name derives.
    // Across hosts mpirun names no master: the user passes one (`mpirun -x MASTER_ADDR -x MASTER_PORT`).
    if env("MASTER_ADDR").is_none() && env("MASTER_PORT").is_none() {
        let job = vars
            .job
            .iter()
            .find_map(|var| env(var))
            .or_else(|| {
                vars.parent_names_job
                    .then(|| format!("proxy {}", std::os::unix::process::parent_id()))
            })
            .filter(|_| local_size == Some(size));
        let Some(job) = job else {
            bail!(
                "{engine}: the ranks are on several hosts (or {} is not set) and no coordinator is named: \
                 pass MASTER_ADDR and MASTER_PORT to every rank (`mpirun -x MASTER_ADDR=host -x MASTER_PORT=port`)",
                vars.local_size
            );
        };
        torchrun.insert("MASTER_ADDR", "127.0.0.1".to_string());
        torchrun.insert("MASTER_PORT", derived_port(&job).to_string());
    }
    Ok(torchrun.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// The rank, sizes and coordinator of a job step `srun` started: the coordinator on the step's
/// first node, at a port the job and step ids derive.
fn slurm(env: &dyn Fn(&str) -> Option<String>) -> Result<HashMap<String, String>> {
    const ENGINE: &str = "Slurm";
    let (rank, tasks) = (
        number(env, "SLURM_PROCID", ENGINE)?,
        number(env, "SLURM_NTASKS", ENGINE)?,
    );
    if let Ok(procs) = number(env, "SLURM_NPROCS", ENGINE) {
        ensure!(
            procs == tasks,
            "Slurm: SLURM_NTASKS = {tasks} contradicts SLURM_NPROCS = {procs}"
        );
    }
    ensure!(
        rank < tasks,
        "Slurm: SLURM_PROCID = {rank} is outside SLURM_NTASKS = {tasks}"
    );
    let (list_var, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
        .iter()
        .find_map(|var| env(var).map(|list| (*var, list)))
        .ok_or_else(|| anyhow!("Slurm: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST is set"))?;
    let hosts = expand_hostlist(&list).with_context(|| format!("Slurm: {list_var} = {list:?}"))?;
    if let Some(me) = env("SLURMD_NODENAME") {
        ensure!(
            hosts.iter().any(|host| host == me.trim()),
            "Slurm: this node, SLURMD_NODENAME = {me}, is not in {list_var} = {list}"
        );
    }
    let first = hosts.first().context("Slurm: an empty node list")?;
    let job = env("SLURM_JOB_ID").context("Slurm: SLURM_JOB_ID is not set")?;
    let step = env("SLURM_STEP_ID").unwrap_or_default();
    let mut torchrun = HashMap::from([
        ("RANK".to_string(), rank.to_string()),
        ("WORLD_SIZE".to_string(), tasks.to_string()),
    ]);
    if let Ok(local_rank) = number(env, "SLURM_LOCALID", ENGINE) {
        torchrun.insert("LOCAL_RANK".to_string(), local_rank.to_string());
    }
    // As many tasks on every node, or no layout flattened into nodes × ranks per node.
    if tasks.is_multiple_of(hosts.len()) {
        torchrun.insert("LOCAL_WORLD_SIZE".to_string(), (tasks / hosts.len()).to_string());
    }
    if env("MASTER_ADDR").is_none() && env("MASTER_PORT").is_none() {
        torchrun.insert("MASTER_ADDR".to_string(), first.clone());
        torchrun.insert(
            "MASTER_PORT".to_string(),
            derived_port(&format!("{}.{}", job.trim(), step.trim())).to_string(),
        );
    }
    Ok(torchrun)
}

/// A port in [`DERIVED_PORTS`] from `job`'s name: every rank of the job computes the same one,
/// and two jobs on one host (almost surely) different ones.
fn derived_port(job: &str) -> u32 {
    // FNV-1a: stable across builds and platforms, unlike the standard library's hasher.
    let hash = job.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    DERIVED_PORTS.start + (hash % u64::from(DERIVED_PORTS.end - DERIVED_PORTS.start)) as u32
}

/// Slurm's compressed host list (`node[01-03,07],gpu5`) as host names, in order.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>> {
    let mut hosts = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    let mut items = Vec::new();
    for (at, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..at]);
                start = at + 1;
            }
            _ => {}
        }
        ensure!((0..=1).contains(&depth), "unbalanced brackets");
    }
    ensure!(depth == 0, "unbalanced brackets");
    items.push(&list[start..]);
    for item in items.into_iter().map(str::trim).filter(|item| !item.is_empty()) {
        let Some((prefix, rest)) = item.split_once('[') else {
            hosts.push(item.to_string());
            continue;
        };
        let (ranges, suffix) = rest.split_once(']').context("unbalanced brackets")?;
        for range in ranges.split(',') {
            let (low, high) = range.split_once('-').unwrap_or((range, range));
            let width = low.len();
            let (from, to): (u64, u64) = (
                low.parse().with_context(|| format!("{low:?} is not a number"))?,
                high.parse().with_context(|| format!("{high:?} is not a number"))?,
            );
            ensure!(from <= to, "the range {range} runs backwards");
            hosts.extend((from..=to).map(|n| format!("{prefix}{n:0width$}{suffix}")));
        }
    }
    ensure!(!hosts.is_empty(), "no hosts");
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name: &str| vars.get(name).cloned()
    }

    #[test]
    fn the_rank_comes_from_paddle_or_torchrun_and_both_must_agree() {
        assert_eq!(rank(&env_of(&[("PADDLE_TRAINER_ID", "2")])).unwrap(), Some(2));
        assert_eq!(rank(&env_of(&[("RANK", "3")])).unwrap(), Some(3));
        assert_eq!(
            rank(&env_of(&[("RANK", "1"), ("PADDLE_TRAINER_ID", "1")])).unwrap(),
            Some(1)
        );
        assert_eq!(rank(&env_of(&[])).unwrap(), None);
        let error = rank(&env_of(&[("RANK", "1"), ("PADDLE_TRAINER_ID", "0")])).unwrap_err();
        assert_eq!(error.to_string(), "RANK = 1 contradicts PADDLE_TRAINER_ID = 0");
        let error = rank(&env_of(&[("RANK", "one")])).unwrap_err();
        assert_eq!(error.to_string(), "RANK = \"one\" is not a rank");
    }

    #[test]
    fn slurm_host_lists_expand_with_their_padding() {
        assert_eq!(
            expand_hostlist("node[01-03,07],gpu5").unwrap(),
            ["node01", "node02", "node03", "node07", "gpu5"]
        );
        assert_eq!(expand_hostlist("a,b").unwrap(), ["a", "b"]);
        assert_eq!(expand_hostlist("r[8-10]-ib").unwrap(), ["r8-ib", "r9-ib", "r10-ib"]);
        assert!(expand_hostlist("node[1-3").is_err());
        assert!(expand_hostlist("node[3-1]").is_err());
    }

    #[test]
    fn an_srun_task_is_a_rank_whose_coordinator_is_on_the_steps_first_node() {
        let slurm = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "node[07-08]"),
            ("SLURMD_NODENAME", "node08"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
        ];
        let torchrun = engine_env(&env_of(&slurm)).unwrap();
        assert_eq!(torchrun["RANK"], "3");
        assert_eq!(torchrun["WORLD_SIZE"], "4");
        assert_eq!(torchrun["LOCAL_RANK"], "1");
        assert_eq!(torchrun["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(torchrun["MASTER_ADDR"], "node07");
        let port: u32 = torchrun["MASTER_PORT"].parse().unwrap();
        assert!(DERIVED_PORTS.contains(&port), "{port}");
        let other_job = engine_env(&env_of(&[&slurm[..6], &[("SLURM_STEP_ID", "1")]].concat())).unwrap();
        assert_ne!(
            other_job["MASTER_PORT"], torchrun["MASTER_PORT"],
            "another step, another port"
        );
    }

    #[test]
    fn slurm_variables_that_contradict_each_other_are_named() {
        let base = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NODELIST", "node[1-2]"),
            ("SLURM_JOB_ID", "7"),
        ];
        let error = |extra: &[(&str, &str)]| {
            let vars = [&base[..], extra].concat();
            format!("{:#}", engine_env(&env_of(&vars)).unwrap_err())
        };
        assert_eq!(
            error(&[("SLURM_NPROCS", "2")]),
            "Slurm: SLURM_NTASKS = 4 contradicts SLURM_NPROCS = 2"
        );
        assert_eq!(
            error(&[("SLURMD_NODENAME", "node9")]),
            "Slurm: this node, SLURMD_NODENAME = node9, is not in SLURM_STEP_NODELIST = node[1-2]"
        );
        let vars = [("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")];
        assert_eq!(
            format!("{:#}", engine_env(&env_of(&vars)).unwrap_err()),
            "Slurm: SLURM_PROCID = 4 is outside SLURM_NTASKS = 4"
        );
    }

    #[test]
    fn mpirun_ranks_on_one_host_derive_their_coordinator_and_on_several_must_name_it() {
        let one_host = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("PMIX_NAMESPACE", "prterun-host-1234@1"),
        ];
        let torchrun = engine_env(&env_of(&one_host)).unwrap();
        assert_eq!(torchrun["RANK"], "1");
        assert_eq!(torchrun["WORLD_SIZE"], "4");
        assert_eq!(torchrun["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(torchrun["MASTER_ADDR"], "127.0.0.1");
        let two_hosts = [&one_host[..3], &[("OMPI_COMM_WORLD_LOCAL_SIZE", "2")]].concat();
        let error = format!("{:#}", engine_env(&env_of(&two_hosts)).unwrap_err());
        assert!(error.contains("pass MASTER_ADDR and MASTER_PORT"), "{error}");
        let named = [&two_hosts[..], &[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "6170")]].concat();
        let torchrun = engine_env(&env_of(&named)).unwrap();
        assert!(!torchrun.contains_key("MASTER_ADDR"), "the user's own variables stand");
        let mpich = [
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALNRANKS", "2"),
            ("PMI_KVSNAME", "kvs_99_0"),
        ];
        assert_eq!(engine_env(&env_of(&mpich)).unwrap()["WORLD_SIZE"], "2");
    }

    #[test]
    fn a_launchers_variables_win_over_the_engines() {
        let slurm = [("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")];
        for launcher in [
            ("RANK", "0"),
            ("TRAINING_ROLE", "PSERVER"),
            ("PADDLE_TRAINERS_NUM", "2"),
        ] {
            let vars = [&slurm[..], &[launcher]].concat();
            assert!(engine_env(&env_of(&vars)).unwrap().is_empty(), "{launcher:?}");
        }
    }
}
