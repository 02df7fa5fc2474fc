//! The trainer of the parameter-server strategy: per batch it has its device actor plan the
//! pull (each id once, grouped by shard), pulls from every shard in parallel, trains, and
//! pushes the update back; at the end every trainer scores its share of the held-out set with
//! the shards' final values (shard 0 joins the shares into one AUC), and trainer 0 has the
//! shards save their tables.
//!
//! In a job that recovers in place, a failure the coordinator explains with a rollback order (a
//! role was lost) — or the order itself, which interrupts whatever the trainer waits for — does
//! not end the trainer: it joins the next generation, restores its own state of the committed
//! checkpoint (geo's; the shards hold the rest) and trains on from that step.

mod steps;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};

use super::ctr_device::{CtrDevice, CtrOwnState, FlushCtr, PlanCtr, PredictCtr, PrepareCtr, RestoreCtrOwnState};
use super::ps_requests::{pull_rows, pull_when_ready, push, shard_stats, sparse_table_metrics, Pulled};
use super::rank_generations::{train_generations, RankGenerations};
use super::recovery::buddy::Buddy;
use super::recovery::faults::RoleFaults;
use super::recovery::kept::{acknowledge_checkpoint, Kept};
use super::recovery::rollback::{takes_rollback_orders, OrderInbox, Orders};
use super::recovery::Recovery;
use super::LOSSES_RESERVED;
use crate::checkpoint::HeldFile;
use crate::config::TrainLength;
use crate::config::{JobConfig, PsMode};
use crate::data::ctr::{CtrLoader, CtrSource, DataPosition};
use crate::models::SparseModelDef;
use crate::net::protocol::Roster;
use crate::net::ControlBus;
use crate::ps::client::PsClient;
use crate::ps::snapshot::shard_file_name;
use crate::ps::wire::{Reply, Request, ShardStats};
use crate::telemetry::monitor::{Monitor, MonitorSettings};
use crate::telemetry::timeline::{Timeline, TraceTarget};

/// What a parameter-server trainer needs.
pub struct PsTrainer {
    /// This trainer's index (`PADDLE_TRAINER_ID`).
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// Its sparse model.
    pub model: SparseModelDef,
    /// Training data (each trainer reads its part of every global batch).
    pub train_data: CtrSource,
    /// Held-out data, each trainer scoring its share.
    pub test_data: CtrSource,
    /// Links to the shards; taken when training starts.
    pub client: Option<PsClient>,
    /// The device actor of this trainer.
    pub device: Addr<CtrDevice>,
    /// Whether the trainer at place 0 has the shards save their tables at the end, each as
    /// `ps-shard-<i>.safetensors` in its own run directory.
    pub save_tables: bool,
    /// How to report every step: trainer 0's only.
    pub monitor: Option<MonitorSettings>,
    /// Where to write this trainer's timeline, and how far the coordinator's clock is ahead.
    pub trace: Option<(TraceTarget, f64)>,
    /// The checkpoint to start from and where new ones are taken.
    pub(crate) recovery: Recovery,
    /// How this trainer rolls back in place; `None` when a lost role stops the job.
    pub in_place: Option<PsInPlace>,
    /// The faults planned for this trainer of a simulated cluster: its training runs under
    /// their switch.
    pub faults: Option<Arc<RoleFaults>>,
    /// Where the coordinator's rollback orders to this actor go: set when it starts, in a job
    /// that rolls back in place.
    pub inbox: Option<OrderInbox>,
}

/// What a parameter-server trainer needs to roll back inside its process.
pub struct PsInPlace {
    /// The line to the coordinator.
    pub bus: ControlBus,
    /// The coordinator's rollback orders.
    pub orders: Orders,
    /// The address announced at each rendezvous: its node's, which holds its checkpoint files.
    pub endpoint: String,
    /// Its checkpoint mirror's address, and how it reaches the next node's.
    pub mirror: Option<(String, Buddy)>,
}

/// Runs the training loop to its end.
#[derive(Message)]
#[rtype(result = "Result<PsOutcome>")]
pub struct TrainPs;

/// What a parameter-server trainer reports.
#[derive(Debug, Clone)]
pub struct PsOutcome {
    /// The trainer.
    pub rank: usize,
    /// Where it trained in the last generation: the trainer at place 0 reports and saves.
    pub place: usize,
    /// Trainers of the last generation (fewer than the job's after elastic membership went on
    /// without some).
    pub trainers: usize,
    /// Steps taken.
    pub steps: usize,
    /// Loss of every step on this trainer's part of the batch.
    pub losses: Vec<f32>,
    /// Samples per second of the whole job (global batch × steps over this trainer's time).
    pub samples_per_sec: f64,
    /// Time in pulls and pushes (waiting for other trainers included) over training time.
    pub comm_time_ratio: f64,
    /// Held-out AUC over every trainer's share.
    pub auc: Option<f64>,
    /// Held-out samples scored by all trainers together.
    pub test_samples: usize,
    /// What each shard holds and applied, at the end (place 0 only).
    pub shards: Vec<ShardStats>,
}

impl PsTrainer {
    /// Starts the trainer actor and trains to the end; an actor that stopped names the trainer.
    pub async fn train(self) -> Result<PsOutcome> {
        let rank = self.rank;
        self.start()
            .send(TrainPs)
            .await
            .map_err(|e| anyhow!("trainer {rank}: actor stopped: {e}"))?
    }
}

takes_rollback_orders!(PsTrainer, |this, in_place| {
    (this.job.cluster.server_num + this.rank, Some(&in_place.bus))
});

impl Handler<TrainPs> for PsTrainer {
    type Result = ResponseFuture<Result<PsOutcome>>;

    fn handle(&mut self, _: TrainPs, _: &mut Self::Context) -> Self::Result {
        let run = PsRun {
            rank: self.rank,
            place: self.rank,
            trainers: self.job.world_size(),
            job: self.job.clone(),
            model: self.model.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            client: self.client.take(),
            device: self.device.clone(),
            save_tables: self.save_tables,
            monitor: self.monitor.clone(),
            trace: self.trace.clone(),
            recovery: self.recovery.clone(),
            kept: Kept::default(),
            resume_data: None,
            roster: None,
            faults: self.faults.clone(),
            orders: None,
        };
        Box::pin(RoleFaults::govern(
            self.faults.clone(),
            run.execute(self.in_place.take()),
        ))
    }
}

struct PsRun {
    rank: usize,
    /// Where the trainer trains in the generation: its part of each batch, its number to the
    /// shards. Its rank, unless elastic membership went on without some trainers.
    place: usize,
    /// Trainers in the generation.
    trainers: usize,
    job: Arc<JobConfig>,
    model: SparseModelDef,
    train_data: CtrSource,
    test_data: CtrSource,
    client: Option<PsClient>,
    device: Addr<CtrDevice>,
    save_tables: bool,
    monitor: Option<MonitorSettings>,
    trace: Option<(TraceTarget, f64)>,
    recovery: Recovery,
    /// This trainer's own state at the checkpoints, when it rolls back in place.
    kept: Kept,
    /// Where the training data resumes, from the checkpoint the trainer starts at; `None`: read
    /// (without parsing where it can) up to the first step.
    resume_data: Option<DataPosition>,
    /// The roster of the generation training, when the job recovers in place.
    roster: Option<Roster>,
    faults: Option<Arc<RoleFaults>>,
    /// The coordinator's rollback orders, when the trainer rolls back in place.
    orders: Option<Orders>,
}

/// A trainer's lines in a job that recovers in place: to the coordinator, and to the next
/// node's checkpoint mirror.
struct InPlaceLine {
    bus: ControlBus,
    /// The address announced at each rendezvous.
    endpoint: String,
    mirror: Option<(String, Buddy)>,
}

impl InPlaceLine {
    /// How the trainer reaches the next node's checkpoint mirror, if it keeps copies there.
    fn buddy(&self) -> Option<&Buddy> {
        self.mirror.as_ref().map(|(_, buddy)| buddy)
    }
}

/// What outlives a rollback: the links to the shards and the coordinator, and what the run
/// has measured so far.
struct PsLoop {
    client: PsClient,
    line: Option<InPlaceLine>,
    progress: Progress,
    /// Steps of the whole run.
    steps: usize,
}

/// What a trainer accumulates over its run, across rollbacks.
struct Progress {
    /// The step the run started after.
    first: usize,
    losses: Vec<f32>,
    comm_time: Duration,
    monitor: Option<Monitor>,
    timeline: Option<Timeline>,
}

impl PsRun {
    /// This trainer's index among the job's roles (servers first).
    fn role(&self) -> usize {
        self.job.cluster.server_num + self.rank
    }

    /// Roles of the job: servers and trainers.
    fn roles(&self) -> usize {
        self.job.cluster.server_num + self.job.world_size()
    }

    async fn execute(mut self, in_place: Option<PsInPlace>) -> Result<PsOutcome> {
        let mut client = self.client.take().context("TrainPs was sent twice")?;
        client.wait_for_servers().await?;
        let steps = self.run_steps()?;
        let mut line = in_place.map(|in_place| {
            self.orders = Some(in_place.orders);
            InPlaceLine {
                bus: in_place.bus,
                endpoint: in_place.endpoint,
                mirror: in_place.mirror,
            }
        });
        // The shards hold the state of a checkpoint; the trainers move on to its step, with
        // their own state (geo's) of that checkpoint.
        let first = match &mut line {
            Some(line) => {
                let roster = self.join(line, &mut client).await?;
                if let Some(orders) = &self.orders {
                    orders.joined(&roster);
                }
                roster.resume_step.unwrap_or(0)
            }
            None => self.recovery.first_step(steps)?,
        };
        self.recovery.check_first_step(first, steps)?;
        self.prepare(first, line.as_ref().and_then(InPlaceLine::buddy)).await?;
        let train = &self.job.train;
        let progress = Progress {
            first,
            losses: Vec::with_capacity(steps.min(LOSSES_RESERVED)),
            comm_time: Duration::ZERO,
            monitor: self
                .monitor
                .as_ref()
                .map(|settings| Monitor::start(settings, steps, first, train.batch_size, train.log_every))
                .transpose()?,
            timeline: self.trace.as_ref().map(|(t, _)| Timeline::new(t.origin.instant)),
        };
        let mut run = PsLoop {
            client,
            line,
            progress,
            steps,
        };
        let started = Instant::now();
        train_generations(&mut self, &mut run, first).await?;
        let PsLoop {
            mut client,
            mut progress,
            ..
        } = run;
        if let Some(updates) = self.device.send(FlushCtr).await?? {
            push(
                &mut client,
                self.place,
                steps as u64,
                &self.job,
                updates,
                "final geo push",
            )
            .await?;
        }
        let elapsed = started.elapsed();
        if let Some(monitor) = &progress.monitor {
            monitor.finish();
        }
        self.write_timeline(&mut progress)?;
        self.finish(&mut client, steps, progress, elapsed).await
    }

    /// Batches of the whole run; only a run measured in epochs counts the records (a byte scan
    /// of the files).
    fn run_steps(&self) -> Result<usize> {
        let train = &self.job.train;
        Ok(match train.length() {
            TrainLength::Steps(steps) => steps,
            length => length.steps((self.train_data.records_per_epoch()? as usize / train.batch_size).max(1))?,
        })
    }

    /// Writes the trainer's timeline, when tracing.
    fn write_timeline(&self, progress: &mut Progress) -> Result<()> {
        if let (Some((trace, clock_offset_us)), Some(mut timeline)) = (&self.trace, progress.timeline.take()) {
            // Servers are tracks 0.., trainers after them, as they are numbered for heartbeats.
            let role = format!("trainer {}", self.rank);
            trace.write(self.role(), &role, *clock_offset_us, timeline.take())?;
        }
        Ok(())
    }

    /// Ends training at the shards, scores this trainer's share of the held-out data (shard 0
    /// answers the AUC over all), has the tables saved (from place 0) and leaves.
    async fn finish(
        &mut self,
        client: &mut PsClient,
        steps: usize,
        progress: Progress,
        elapsed: Duration,
    ) -> Result<PsOutcome> {
        let place = self.place;
        let servers = client.server_num();
        let everyone = |request: Request| vec![request; servers];
        client
            .call_all(everyone(Request::EndTraining { trainer: place }), "end of training")
            .await?;
        let (auc, test_samples) = self.evaluate(client, steps as u64).await?;
        let shards = if place == 0 {
            let shards = shard_stats(client).await?;
            if self.save_tables {
                client.call_all(everyone(Request::Save), "save of the tables").await?;
            }
            shards
        } else {
            Vec::new()
        };
        client
            .call_all(everyone(Request::Leave { trainer: place }), "leave")
            .await?;
        let trained = steps - progress.first;
        let seconds = elapsed.as_secs_f64().max(1e-9);
        Ok(PsOutcome {
            rank: self.rank,
            place,
            trainers: self.trainers,
            steps,
            losses: progress.losses,
            samples_per_sec: (trained * self.job.train.batch_size) as f64 / seconds,
            comm_time_ratio: progress.comm_time.as_secs_f64() / seconds,
            auc,
            test_samples,
            shards,
        })
    }

    /// Joins the forming generation — with elastic membership, once admitted — at its place
    /// among the generation's trainers: its requests carry it from now on. Returns its roster.
    async fn join(&mut self, in_place: &mut InPlaceLine, client: &mut PsClient) -> Result<Roster> {
        let roster = in_place
            .bus
            .join_admitted(
                self.role(),
                self.roles(),
                in_place.endpoint.clone(),
                in_place.mirror.as_ref().map(|(endpoint, _)| endpoint.clone()),
                self.job.shared_settings(),
            )
            .await?;
        self.recovery.check_joined(&roster)?;
        client.enter(roster.generation);
        let servers = self.job.cluster.server_num;
        let trainers: Vec<usize> = roster.members().into_iter().filter(|&m| m >= servers).collect();
        let place = trainers.iter().position(|&m| m == self.role()).with_context(|| {
            format!(
                "trainer {} is not in the roster of generation {}",
                self.rank, roster.generation
            )
        })?;
        if (place, trainers.len()) != (self.place, self.trainers) {
            // The own state kept in memory is of another place.
            self.kept = Kept::default();
            (self.place, self.trainers) = (place, trainers.len());
        }
        if roster.generation > 0 {
            tracing::info!(
                trainer = self.rank,
                generation = roster.generation,
                resume_step = roster.resume_step.unwrap_or(0),
                place,
                trainers = self.trainers,
                "rejoined"
            );
        }
        self.roster = Some(roster.clone());
        Ok(roster)
    }

    /// A fresh worker on the device, with this trainer's own state after `step` steps — where
    /// its data resumes, and geo's local optimizer state: kept in memory, else from its node's
    /// disk, else from the copy on the next node. A checkpoint written by another number of
    /// trainers holds their parts of the batch: the data resumes at the positions every trainer
    /// saved (the parts are the same), and the geo trainers' local optimizer states start
    /// afresh (the shards hold the model).
    async fn prepare(&mut self, step: usize, buddy: Option<&Buddy>) -> Result<()> {
        let (job, rank) = (self.job.clone(), self.rank);
        self.resume_data = None;
        self.device
            .send(PrepareCtr {
                job: job.clone(),
                model: self.model.clone(),
                rank,
            })
            .await??;
        if step == 0 {
            return Ok(());
        }
        let geo = matches!(job.strategy.ps_mode(), PsMode::Geo { .. });
        // The run may start from a checkpoint of another number of servers (resharding).
        let servers_then = match &self.recovery.start {
            Some(start) if start.step == step => start.numbered_files(shard_file_name).len(),
            _ => job.cluster.server_num,
        };
        let written_by = self
            .recovery
            .writers(step, self.roster.as_ref())?
            .saturating_sub(servers_then);
        if written_by != self.trainers {
            if geo {
                tracing::warn!(
                    trainer = rank,
                    step,
                    written_by,
                    trainers = self.trainers,
                    "geo: the checkpoint holds the local states of another number of trainers; this one's starts afresh"
                );
            }
            self.resume_data = self.data_positions(step, written_by);
            return Ok(());
        }
        let state = match self.own_state(step, buddy).await {
            Ok(bytes) => TrainerState::decode(&bytes)?,
            // A checkpoint of a version that saved no trainer state outside geo mode.
            Err(missing) if !geo => {
                tracing::warn!(
                    trainer = rank,
                    step,
                    "no data position in the checkpoint ({missing:#}): reading up to it"
                );
                return Ok(());
            }
            Err(missing) => return Err(missing),
        };
        self.resume_data = Some(state.data);
        match state.geo {
            Some(geo_state) => self.device.send(RestoreCtrOwnState(Arc::new(geo_state))).await?,
            None => Ok(()),
        }
    }

    /// This trainer's own file of the checkpoint after `step` steps.
    async fn own_state(&mut self, step: usize, buddy: Option<&Buddy>) -> Result<Arc<Vec<u8>>> {
        if let Some(bytes) = self.kept.at(step) {
            return Ok(bytes);
        }
        let rank = self.rank;
        let name = trainer_file_name(self.place);
        let bytes = match (
            self.recovery.read_committed(step, None, self.roster.as_ref(), &name),
            buddy,
            &self.roster,
        ) {
            (Ok(bytes), _, _) => bytes,
            (Err(disk), Some(buddy), Some(roster)) => {
                let (bytes, from) = buddy.fetch(roster, self.role(), step, &name).await.with_context(|| {
                    format!("trainer {rank}: its state of step {step} is neither on this node's disk ({disk:#}) nor on the next node")
                })?;
                tracing::info!(trainer = rank, step, from, "own state restored");
                Arc::new(bytes)
            }
            (Err(disk), _, _) => return Err(disk),
        };
        self.kept.taken(step, bytes.clone());
        self.kept.committed();
        Ok(bytes)
    }

    /// The data positions the `written_by` trainers of the checkpoint after `step` steps saved,
    /// joined; `None` (read up to the step instead) where one cannot be read.
    fn data_positions(&self, step: usize, written_by: usize) -> Option<DataPosition> {
        let mut joined = DataPosition::default();
        for place in 0..written_by {
            let read = self
                .recovery
                .read_committed(step, None, self.roster.as_ref(), &trainer_file_name(place))
                .and_then(|bytes| TrainerState::decode(&bytes));
            match read {
                Ok(state) => joined.merge(state.data),
                Err(error) => {
                    tracing::warn!(
                        trainer = self.rank,
                        step,
                        place,
                        "no data position of the trainer at place {place} ({error:#}): reading up to the step"
                    );
                    return None;
                }
            }
        }
        Some(joined)
    }

    /// The checkpoint after `step` steps, the quiesce point of every mode: this trainer has
    /// pushed its steps before `step` and asks every shard for the checkpoint; the shards take
    /// it once every trainer has asked (no trainer pushes on before), and answer them all. Every
    /// trainer writes its own state beside theirs (its data position; geo's optimizer state).
    /// In a job that recovers in place every role
    /// then acknowledges its files to the coordinator, and the first role on each node commits
    /// that node's copy; otherwise trainer 0 commits what the shards answered.
    async fn checkpoint(
        &mut self,
        client: &mut PsClient,
        step: usize,
        data: DataPosition,
        in_place: Option<&mut InPlaceLine>,
    ) -> Result<()> {
        let store = self.recovery.checkpoint_store()?;
        let place = self.place;
        let own = TrainerState {
            data,
            geo: self.device.send(CtrOwnState).await??,
        };
        let bytes = Arc::new(own.encode()?);
        let writer = store.clone();
        let file = bytes.clone();
        let write = tokio::task::spawn_blocking(move || writer.write(step, &trainer_file_name(place), &file));
        let written = write.await.context("the checkpoint writer stopped")??;
        let mut held = HeldFile::here(written.clone());
        if let Some(line) = &in_place {
            self.kept.taken(step, bytes.clone());
            // No other node holds a trainer's own state.
            if let (Some(buddy), Some(roster)) = (line.buddy(), &self.roster) {
                held.nodes
                    .extend(buddy.copy(roster, self.role(), step, &written.name, &bytes).await?);
            }
        }
        let files = vec![held];
        let ask = Request::Checkpoint {
            step: step as u64,
            trainer: place,
            files: files.iter().map(|held| held.record.clone()).collect(),
        };
        let answers = client
            .call_all(vec![ask; client.server_num()], &format!("checkpoint of step {step}"))
            .await?;
        match in_place {
            Some(line) => {
                let (role, roster) = (self.role(), self.roster.as_ref());
                acknowledge_checkpoint(&mut line.bus, (role, step), files, Some(&mut self.kept), &store, roster).await
            }
            None if place == 0 => {
                let mut files = Vec::new();
                for (shard, answer) in answers.into_iter().enumerate() {
                    let Reply::Checkpointed(records) = answer else {
                        anyhow::bail!("parameter server {shard} answered a checkpoint order with {answer:?}");
                    };
                    // Each answer is the shard's file, then every trainer's: those once.
                    let take = if shard == 0 { records.len() } else { 1 };
                    files.extend(records.into_iter().take(take));
                }
                store.commit(step, self.roles(), files)
            }
            None => Ok(()),
        }
    }

    /// AUC of the shards' final values on the held-out set (once every trainer has ended):
    /// this trainer scores its share and sends it to shard 0, which answers once every trainer
    /// has, with the AUC over them all and the samples scored.
    async fn evaluate(&self, client: &mut PsClient, version: u64) -> Result<(Option<f64>, usize)> {
        let (rank, place) = (self.rank, self.place);
        let mut loader = CtrLoader::evaluation(self.test_data.clone(), self.job.train.batch_size, place, self.trainers)
            .with_context(|| format!("trainer {rank}: held-out data"))?;
        let (mut scores, mut labels) = (Vec::new(), Vec::new());
        while let Some(batch) = loader.next_eval_batch()? {
            labels.extend_from_slice(&batch.labels);
            let plan = self.device.send(PlanCtr { batch, training: false }).await??;
            let pulled = pull_rows(client, place, version, true, plan, "pull for evaluation").await?;
            scores.extend(self.device.send(PredictCtr(pulled)).await??);
        }
        let share = Request::Evaluated {
            trainer: place,
            scores,
            labels,
        };
        // One request: shard 0 alone gathers the shares.
        match client.call_all(vec![share], "evaluation").await?.pop() {
            Some(Reply::Evaluation { auc, samples }) => Ok((auc, samples as usize)),
            other => anyhow::bail!("parameter server 0 answered trainer {rank}'s evaluation share with {other:?}"),
        }
    }
}

impl RankGenerations for PsRun {
    type Run = PsLoop;
    type Outcome = ();

    fn rank(&self) -> usize {
        self.rank
    }

    /// The generation's steps, interrupted where a rollback order comes (the shards a trainer
    /// waits for may be lost).
    async fn generation(&mut self, run: &mut PsLoop, first: usize) -> Result<()> {
        let interruption = self.orders.as_ref().map(Orders::interruption);
        let training = self.train_steps(&mut run.client, first, run.steps, &mut run.progress, run.line.as_mut());
        match interruption {
            Some(interruption) => interruption.of(training).await,
            None => training.await,
        }
    }

    fn orders(&mut self) -> Option<&mut Orders> {
        self.orders.as_mut()
    }

    /// Its join says so, with its place among the trainers (a replacement's first join too).
    fn rejoined(&self, _roster: &Roster) {}

    /// Joins the next generation and restores this trainer's own state of its checkpoint (the
    /// shards restore theirs).
    async fn rejoin(&mut self, run: &mut PsLoop) -> Result<Roster> {
        let line = run.line.as_mut().context("a rollback without in-place recovery")?;
        let roster = self.join(line, &mut run.client).await?;
        let first = roster.resume_step.unwrap_or(0);
        let progress = &mut run.progress;
        progress.losses.truncate(first.saturating_sub(progress.first));
        self.prepare(first, line.buddy()).await?;
        Ok(roster)
    }

    /// Every trainer stopped after the same step: the shards may go once all left.
    async fn preempted(&mut self, run: &mut PsLoop) {
        let leave = vec![Request::Leave { trainer: self.place }; run.client.server_num()];
        if let Err(e) = run.client.call_all(leave, "leave").await {
            tracing::warn!(trainer = self.rank, "leaving the shards after stopping: {e:#}");
        }
    }
}

/// The file of the own state of the trainer at place `place` in a checkpoint.
pub fn trainer_file_name(place: usize) -> String {
    format!("ps-trainer-{place}.state")
}

/// What a trainer saves of its own at a checkpoint: where its data is, and in geo mode its
/// local optimizer's state.
#[derive(serde::Serialize, serde::Deserialize)]
struct TrainerState {
    data: DataPosition,
    geo: Option<Vec<u8>>,
}

impl TrainerState {
    fn encode(&self) -> Result<Vec<u8>> {
        postcard::to_stdvec(self).context("encoding a trainer's state")
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        postcard::from_bytes(bytes).context("a trainer's state file is malformed")
    }
}
