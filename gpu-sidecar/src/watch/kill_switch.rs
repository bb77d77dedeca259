//! The kill switch: flipped by an admin call or the fleet, kept in a state
//! file written atomically so a restart keeps it, published through the
//! state store and announced to the alerts.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::state::{KillSwitch, StateStore};
use crate::watch::alerts::{AlertEvent, Alerts};

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("reading the state file {0}: {1}")]
    StateRead(PathBuf, std::io::Error),
    #[error("the state file {0} is not what this sidecar wrote ({1}); fix or remove it")]
    StateParse(PathBuf, serde_json::Error),
}

/// What the state file holds.
#[derive(Debug, Serialize, Deserialize)]
struct Persisted {
    kill_switch: KillSwitch,
}

/// The kill switch as last saved in `path`; off when there is no file.
pub fn load_kill_switch(path: &Path) -> Result<KillSwitch, StateFileError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<Persisted>(&bytes)
            .map(|p| p.kill_switch)
            .map_err(|e| StateFileError::StateParse(path.into(), e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KillSwitch::default()),
        Err(e) => Err(StateFileError::StateRead(path.into(), e)),
    }
}

/// Writes a temp file beside `path`, syncs it, renames it over `path` and
/// syncs the folder: after a crash the file is the old or the new one.
pub fn save_kill_switch(path: &Path, ks: &KillSwitch) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(&Persisted {
        kill_switch: ks.clone(),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "state".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&body)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    // Makes the rename itself durable; not every platform can open a folder.
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// What an admin change did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KillSwitchOutcome {
    pub kill_switch: KillSwitch,
    pub version: u64,
    /// Saved to the state file (false with no state file, or when saving
    /// failed: the switch still holds until restart).
    pub persisted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// Flips the kill switch: saves, publishes, alerts. One at a time, so the
/// file and the published state agree.
#[derive(Debug)]
pub struct KillSwitchControl {
    store: StateStore,
    state_file: Option<PathBuf>,
    alerts: Option<Alerts>,
    lock: tokio::sync::Mutex<()>,
}

impl KillSwitchControl {
    pub fn new(store: StateStore, state_file: Option<PathBuf>, alerts: Option<Alerts>) -> Self {
        KillSwitchControl {
            store,
            state_file,
            alerts,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    pub async fn set(
        &self,
        active: bool,
        reason: Option<String>,
        now: SystemTime,
    ) -> KillSwitchOutcome {
        let _one_at_a_time = self.lock.lock().await;
        let old = self.store.current().kill_switch.clone();
        let next = KillSwitch {
            active,
            reason,
            since: if old.active == active {
                old.since
            } else {
                Some(now)
            },
        };
        let mut warning = None;
        let persisted = match &self.state_file {
            None => {
                warning =
                    Some("no state file configured: a restart forgets the kill switch".into());
                false
            }
            Some(path) => {
                let path = path.clone();
                let ks = next.clone();
                match tokio::task::spawn_blocking(move || save_kill_switch(&path, &ks)).await {
                    Ok(Ok(())) => true,
                    Ok(Err(e)) => {
                        warning = Some(format!("not saved: {e}"));
                        false
                    }
                    Err(e) => {
                        warning = Some(format!("not saved: {e}"));
                        false
                    }
                }
            }
        };
        if let Some(w) = &warning {
            if self.state_file.is_some() {
                eprintln!("sluice-sidecar: kill switch: {w}");
            }
        }
        // Applied even when saving failed: an operator pulling the switch
        // in an incident must not be refused over a full disk.
        self.store.update(now, |s| s.kill_switch = next.clone());
        if old.active != active {
            eprintln!(
                "sluice-sidecar: kill switch {} ({})",
                if active { "ON" } else { "off" },
                next.reason.as_deref().unwrap_or("no reason given")
            );
            if let Some(a) = &self.alerts {
                a.send(AlertEvent::KillSwitch {
                    active,
                    reason: next.reason.clone(),
                    at: now,
                });
            }
        }
        KillSwitchOutcome {
            kill_switch: next,
            version: self.store.current().version,
            persisted,
            warning,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn state_file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(load_kill_switch(&path).unwrap(), KillSwitch::default());
        let ks = KillSwitch {
            active: true,
            reason: Some("GPU fire".into()),
            since: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
        };
        save_kill_switch(&path, &ks).unwrap();
        assert_eq!(load_kill_switch(&path).unwrap(), ks);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
        std::fs::write(&path, "{").unwrap();
        assert!(load_kill_switch(&path).is_err());
    }

    #[tokio::test]
    async fn control_saves_publishes_and_keeps_since() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let store = StateStore::new(SystemTime::UNIX_EPOCH);
        let ctl = KillSwitchControl::new(store.clone(), Some(path.clone()), None);
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let out = ctl.set(true, Some("drill".into()), t(10)).await;
        assert!(out.persisted);
        assert_eq!(out.version, 2);
        assert_eq!(store.current().kill_switch.since, Some(t(10)));
        let out = ctl.set(true, Some("still drilling".into()), t(20)).await;
        assert_eq!(out.kill_switch.since, Some(t(10)), "still on since 10");
        assert_eq!(
            load_kill_switch(&path).unwrap().reason.as_deref(),
            Some("still drilling")
        );
        let out = ctl.set(false, None, t(30)).await;
        assert_eq!(out.kill_switch.since, Some(t(30)));
        assert!(!load_kill_switch(&path).unwrap().active);

        let no_file = KillSwitchControl::new(StateStore::new(t(0)), None, None);
        let out = no_file.set(true, None, t(1)).await;
        assert!(!out.persisted);
        assert!(out.warning.is_some());
    }
}
