//! Once the body is read: the request's run (`runs`), set on its
//! identity, and the loop guard (`loop_guard`). Both before the cache, so
//! a refused request is refused whatever the cache holds.

use super::*;
use crate::admission::runs::LoopSeen;
use crate::admission::Asked;

impl Stream {
    /// The identity with its run, or the refusal already answered (a bad
    /// or missing run id: 400; a loop: 429 `loop_detected`).
    pub(super) fn runs_and_loops(
        &mut self,
        host: &dyn Host,
        identity: Rc<Identity>,
        asked: Option<&Asked>,
        body: &[u8],
    ) -> Result<Rc<Identity>, Action> {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        if asked.is_some() && engine.policy.loop_guard.is_some() {
            let (seen, effort) =
                engine.loop_seen(host, &identity, &self.path, body, self.started_ms);
            count_contention(host, effort);
            match seen {
                LoopSeen::Fine => {}
                LoopSeen::Untracked => add(host, metrics::LOOP_GUARD_UNTRACKED, 1),
                LoopSeen::Loop { retry_after_ms } => {
                    let verdict = engine.loop_refusal(&identity, retry_after_ms);
                    return Err(self.finish(host, verdict));
                }
            }
        }
        let view = HostRequest(host, self.request_headers.as_ref());
        match engine.run_of(&identity, &view, asked) {
            Ok(None) => Ok(identity),
            Ok(Some(run)) => {
                let with_run = Rc::new(Identity {
                    run: Some(run),
                    ..(*identity).clone()
                });
                self.identity = Some(with_run.clone());
                Ok(with_run)
            }
            Err(verdict) => Err(self.finish(host, *verdict)),
        }
    }
}
