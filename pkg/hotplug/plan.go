package hotplug

import (
	"cmp"
	"slices"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// plan is what one look at a VM decided.
type plan struct {
	// resolve answers intents whose outcome is now observed.
	resolve []resolution
	// changes are to be written now, removals first.
	changes []Change
	// cleanup lists volumes whose refused attach must be undone: the queue
	// takes a detach intent of its own for each.
	cleanup []string
	// hold says why changes wait (empty: they don't); wakeAt is when to look
	// again if no informer event comes first.
	hold   string
	wakeAt time.Time
}

type resolution struct {
	it  *intent
	err error
}

// decide compares a VM's intents with what the informers show and picks what
// to answer and what to write. It updates w's expectations and settling clock.
func decide(now time.Time, cfg Config, w *vmWork, o observed, refusal func(*kubevirtv1.VirtualMachine, string) error) plan {
	var p plan
	for vol, e := range w.expect {
		if reflected(o, vol, e.op) || now.Sub(e.since) >= cfg.MaxHold {
			delete(w.expect, vol)
		} else {
			p.wake(e.since.Add(cfg.MaxHold))
		}
	}

	var removes, adds []Change
	for _, vol := range sortedKeys(w.intents) {
		it := w.intents[vol]
		if _, ok := w.expect[vol]; ok {
			continue // our own write is not visible yet: judge nothing
		}
		addReq, removeReq := o.requested(vol)
		switch it.op {
		case Attach:
			switch {
			case o.attached(vol):
				p.resolve = append(p.resolve, resolution{it: it})
			case o.vm == nil:
				p.resolve = append(p.resolve, resolution{it: it, err: ErrVMNotFound})
			case !o.inVMSpec(vol) && !addReq:
				adds = append(adds, Change{Volume: vol, Op: Attach})
			case addReq && !removeReq:
				// A queued add the host refused blocks every request behind
				// it: fail this volume and withdraw its request.
				if err := refusal(o.vm, vol); err != nil {
					p.resolve = append(p.resolve, resolution{it: it, err: &RejectedError{Volume: vol, VM: it.vm, Op: Attach, Err: err}})
					p.cleanup = append(p.cleanup, vol)
					removes = append(removes, Change{Volume: vol, Op: Detach})
				}
			}
		case Detach:
			switch {
			case o.detached(vol):
				p.resolve = append(p.resolve, resolution{it: it})
			case o.inVMSpec(vol) && !removeReq, addReq && !removeReq:
				removes = append(removes, Change{Volume: vol, Op: Detach})
			case o.inVMISpec(vol) && !removeReq && o.vm != nil && !o.settling():
				// The VMI holds a volume its VM does not: a legacy pass that
				// patched the VMI and then failed to update the VM.
				removes = append(removes, Change{Volume: vol, Op: Detach})
			}
		}
	}
	p.changes = append(removes, adds...)
	if len(p.changes) == 0 {
		return p
	}

	if now.Before(w.gatherUntil) {
		p.hold = "gathering a batch"
		p.wake(w.gatherUntil)
		return p
	}
	if o.settling() || len(w.expect) > 0 {
		if w.settlingSince.IsZero() {
			w.settlingSince = now
		}
		start := w.settlingSince
		if now.Sub(start) < cfg.MaxHold {
			p.hold = "previous change still settling"
			p.wake(start.Add(cfg.MaxHold))
			return p
		}
	} else {
		w.settlingSince = time.Time{}
	}
	return p
}

func (p *plan) wake(t time.Time) {
	if p.wakeAt.IsZero() || t.Before(p.wakeAt) {
		p.wakeAt = t
	}
}

// reflected reports whether the informers show a write this process made.
// A removal counts as shown once the VMI spec has dropped the volume too (or
// a legacy remove request is queued): until then KubeVirt is still acting on
// it, and asking again would only repeat the request.
func reflected(o observed, vol string, op Op) bool {
	inSpec := o.inVMSpec(vol)
	addReq, removeReq := o.requested(vol)
	if op == Attach {
		return inSpec || addReq
	}
	return (!inSpec && !addReq && !o.inVMISpec(vol)) || removeReq
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, cmp.Compare)
	return keys
}
