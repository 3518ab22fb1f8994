package hotplug

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// plan is what one look at a VM decided. decide only returns it; sync
// applies it to the VM's work.
type plan struct {
	// resolve answers intents whose outcome is now known.
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
	// joins says the changes join the attachment pod KubeVirt is starting
	// for the VM's last write (joinable) instead of waiting for its cycle.
	joins bool
	// withdraws says the changes are removals of adds whose attach intents
	// stay: withdrawn from a live migration (withdrawFromMigration).
	withdraws bool
	// expired lists expectations to forget: the informers show the write, or
	// it went unobserved for MaxHold.
	expired []string
	// settlingSince is the VM's settling clock after this look, and progress
	// the fingerprint of KubeVirt's work it was last reset for.
	settlingSince time.Time
	progress      string
	// stalledSince is since when the VM's queued legacy requests have shown
	// no progress (zero: none queued), and stallMark the fingerprint it was
	// last reset for; wakeKubeVirt says to wake KubeVirt's VM controller
	// for them now (stalledRequests).
	stalledSince time.Time
	stallMark    string
	wakeKubeVirt bool
	// waits says, per volume with an intent that is neither answered nor
	// written now, what it waits for.
	waits map[string]waitFor
}

type resolution struct {
	it  *intent
	err error
}

// facts is what the worker gathered about a VM besides its own work.
type facts struct {
	// o is the VM and VMI as the informers show them.
	o observed
	// held has, per exclusive attach intent, why another VM holds the volume
	// (informers and this process's other work); absent means free.
	held map[string]error
	// vmGone says the API server itself confirmed the VM does not exist.
	// Without it, a VM missing from the informer may only be new.
	vmGone bool
	// refused has, per attach intent, the host's refusal of its queued add
	// request (Backend.Refusal); absent means none.
	refused map[string]error
	// migrating says between which host nodes the VMI is in a live
	// migration, from its target's virt-launcher pod on ("": none;
	// migrate.go).
	migrating string
}

// vmLookAgain is how soon a VM that the informer does not show yet, but the
// API server has, is looked at again.
const vmLookAgain = time.Second

// migrationLookAgain is how soon a migrating VM is looked at again.
const migrationLookAgain = 2 * time.Second

// decide compares a VM's intents with the facts and picks what to answer and
// what to write. It is a pure function of its arguments and changes nothing.
func decide(now time.Time, cfg Config, w *vmWork, f facts) plan {
	p := plan{settlingSince: w.settlingSince, progress: w.progress, waits: map[string]waitFor{}}
	o := f.o
	p.stalledRequests(now, cfg, w, o, f.migrating != "")
	pending := map[string]bool{} // unexpired expectations
	for _, vol := range sortedKeys(w.expect) {
		e := w.expect[vol]
		if reflected(o, vol, e.op) || now.Sub(e.since) >= cfg.MaxHold {
			p.expired = append(p.expired, vol)
			continue
		}
		pending[vol] = true
		p.wake(e.since.Add(cfg.MaxHold))
	}

	var removes, adds []Change
	for _, vol := range sortedKeys(w.intents) {
		it := w.intents[vol]
		if pending[vol] {
			p.waits[vol] = waitFor{why: "waiting for the host to show the change this driver wrote"}
			continue // our own write is not visible yet: judge nothing
		}
		addReq, removeReq := o.requested(vol)
		switch it.op {
		case Attach:
			switch {
			case o.attached(vol):
				p.resolve = append(p.resolve, resolution{it: it})
			case o.vm == nil && f.vmGone:
				p.resolve = append(p.resolve, resolution{it: it, err: &VMNotFoundError{VM: it.vm, Volume: it.volume, Namespace: cfg.Namespace}})
			case o.vm == nil:
				p.hold = "VM not in the informer yet"
				p.waits[vol] = waitFor{why: "waiting for the VM to appear in the driver's cache"}
				p.wake(now.Add(vmLookAgain))
			case !o.inVMSpec(vol) && !addReq:
				if err := f.held[vol]; err != nil && it.exclusive {
					p.resolve = append(p.resolve, resolution{it: it, err: err})
					continue
				}
				if o.onlyInVMI(vol) && !o.unplugging(vol) {
					// The VMI holds the volume and is not letting it go,
					// yet its VM lost it: legacy KubeVirt applied a removal
					// to the VM only, its VMI cache not showing yet the add
					// it had just made (kubevirt v1.7.0
					// pkg/virt-controller/watch/vm/vm.go:806-842 reads the
					// VMI's volumes once, from the informer, before the
					// requests), and nothing brings them back together.
					// Adding it to the VM again does: the controller skips
					// the VMI, which has it, and the attach completes on
					// the entry that is there.
					adds = append(adds, Change{Volume: vol, Op: Attach})
					continue
				}
				if o.inVMISpec(vol) || o.status(vol) != nil {
					// The VMI still holds the previous attachment. Adding the
					// volume again before KubeVirt dropped it can leave the
					// entry stuck for good in KubeVirt before 1.8.2 (a
					// terminating attachment pod taken for the current one),
					// so this waits for the entry to go, however long.
					p.waits[vol] = o.onKubeVirt(vol, WedgePreviousAttachment, "waiting for the VMI to drop the previous attachment of the volume ("+o.phase(vol)+")")
					continue
				}
				adds = append(adds, Change{Volume: vol, Op: Attach})
			case addReq && !removeReq:
				// A passing refusal of a volume no other VM holds waits for
				// KubeVirt's retry; a held volume is refused below.
				var passing *PassingRefusal
				if err := f.refused[vol]; errors.As(err, &passing) && f.held[vol] == nil {
					p.waits[vol] = o.onKubeVirt(vol, WedgeQueuedRequest, "waiting for the host to accept the queued add request it refused for now: "+err.Error())
					continue
				}
				// A queued add the host refused blocks every request behind
				// it: fail this volume and withdraw its request.
				if err := f.refused[vol]; err != nil {
					p.resolve = append(p.resolve, resolution{it: it, err: &RejectedError{Volume: vol, VM: it.vm, Op: Attach, Err: err}})
					p.cleanup = append(p.cleanup, vol)
					removes = append(removes, Change{Volume: vol, Op: Detach})
					continue
				}
				p.waits[vol] = o.onKubeVirt(vol, WedgeQueuedRequest, "waiting for KubeVirt's VM controller to take the queued add request")
			default:
				p.waits[vol] = o.onKubeVirt(vol, WedgePlug, "waiting for KubeVirt to plug the volume into the VM ("+o.phase(vol)+")")
			}
		case Detach:
			switch {
			case o.detached(vol):
				p.resolve = append(p.resolve, resolution{it: it})
			case o.inVMSpec(vol) && !removeReq, addReq && !removeReq:
				removes = append(removes, Change{Volume: vol, Op: Detach})
			case o.onlyInVMI(vol) && !o.settling():
				// The VMI holds a volume its VM does not: a legacy pass that
				// patched the VMI and then failed to update the VM.
				removes = append(removes, Change{Volume: vol, Op: Detach})
			default:
				p.waits[vol] = o.onKubeVirt(vol, WedgeUnplug, "waiting for KubeVirt to unplug the volume ("+o.phase(vol)+")")
			}
		}
	}
	if cfg.Strategy.OneRemovalAtATime && o.deviceMayBeGone() {
		removes = p.limitRemovals(o, pending, w, removes)
	}
	adds = p.refuseOverLimit(cfg, w, o, pending, removes, adds)
	p.changes = append(removes, adds...)
	if f.migrating != "" {
		// No hot-plug is written into a migration (migrate.go); the
		// target's pods and the hand-off show in the VMI, and its source
		// pod's end does not: look again soon. Adds of ours that were
		// on their way when it began are withdrawn before its hand-off,
		// so that it can reach it, and go out again after it.
		p.wake(now.Add(migrationLookAgain))
		p.waitAll("waiting for the VM's live migration (" + f.migrating + ") to end: a hot-plug written now is carried out only after it, and one written before its hand-off can keep a Longhorn volume from attaching on either host node")
		p.changes = p.withdrawFromMigration(w, o, pending)
		p.withdraws = len(p.changes) > 0
		if !p.withdraws {
			p.hold = "live migration under way"
		}
		return p
	}
	if len(p.changes) == 0 {
		return p
	}
	if now.Before(w.gatherUntil) {
		p.hold = "gathering a batch"
		p.wake(w.gatherUntil)
		p.waitAll("queued: gathering a batch")
		return p
	}
	if (o.settling() || len(pending) > 0) && joinable(now, cfg, w, o, pending, removes) {
		p.joins = true
		p.hold = ""
		return p
	}
	if o.settling() || len(pending) > 0 {
		// The hold is bounded by the time since KubeVirt last moved, not
		// since it began: replacing an attachment pod takes as long as it
		// takes, and changing the hotplug set meanwhile makes KubeVirt start
		// over (kubevirt 16937). Only a VM where nothing has moved for
		// MaxHold is written anyway, since nothing else can progress.
		if fp := o.progressMark(); p.settlingSince.IsZero() || fp != p.progress {
			p.settlingSince, p.progress = now, fp
		}
		bound := cfg.MaxHold
		if o.podStarting() {
			bound = max(bound, cfg.PodStartHold)
		}
		if now.Sub(p.settlingSince) < bound {
			p.hold = "previous change still settling"
			p.wake(p.settlingSince.Add(bound))
			p.waitAll(queuedBehind(o, pending))
			return p
		}
	} else {
		p.settlingSince = time.Time{}
	}
	p.hold = ""
	return p
}

// stalledRequests watches the VM's queued legacy requests and says when to
// wake KubeVirt's VM controller for them: when nothing KubeVirt shows of the
// VM's hotplug work has moved for cfg.MaxHold, since they were queued or
// since the last wake. That controller retries a VM whose update failed
// after a backoff that doubles to 1000 s, and under churn every one of its
// updates can fail: each conflicts with a request virt-api queued on the VM
// meanwhile. When the writes stop, the last requests wait out the backoff
// reached by then, minutes, unless an event of the VM wakes the controller
// (host.Client.WakeVM). The lab's default scenario on Harvester 1.7.0's real
// control plane left five removals queued that way. Not while the VM
// migrates: its hot-plugs wait for the migration anyway.
func (p *plan) stalledRequests(now time.Time, cfg Config, w *vmWork, o observed, migrating bool) {
	if o.vm == nil || len(o.vm.Status.VolumeRequests) == 0 || migrating || cfg.MaxHold <= 0 {
		return
	}
	p.stalledSince, p.stallMark = w.stalledSince, w.stallMark
	if mark := o.progressMark(); p.stalledSince.IsZero() || mark != p.stallMark {
		p.stalledSince, p.stallMark = now, mark
	}
	due := p.stalledSince.Add(cfg.MaxHold)
	if w.wokeAt.After(p.stalledSince) {
		due = w.wokeAt.Add(cfg.MaxHold)
	}
	if now.Before(due) {
		p.wake(due)
		return
	}
	p.wakeKubeVirt = true
	p.wake(now.Add(cfg.MaxHold))
}

// withdrawFromMigration lists, as removals, the adds of the VM's attach
// intents that a live migration caught before its hand-off with their
// attachment pod not started. KubeVirt builds the migration target's
// attachment pod from every hot-plug volume in the VMI spec (kubevirt
// v1.7.0 pkg/controller/controller.go:553-568, used by
// pkg/virt-controller/watch/migration/migration.go:1389), so such a
// volume, not attached anywhere yet, gets a Longhorn attachment ticket on
// the source node (its own pending attachment pod) and on the target, and
// Longhorn attaches a migratable volume in that state on neither
// (longhorn-manager v1.10.1 controller/volume_attachment_controller.go:
// 692-703): the target's attachment pod never runs and the migration never
// reaches its hand-off. Withdrawn, the volume keeps only the target's
// ticket and attaches there; the intent stays and is written again once
// the migration ended. Nothing mounted is withdrawn: an entry whose
// attachment pod runs, or that is MountedToPod or Ready, is attached on
// the source node already and migrates with the VM.
func (p *plan) withdrawFromMigration(w *vmWork, o observed, pending map[string]bool) []Change {
	if o.migration() != nil {
		return nil // after the hand-off: every pod it needs runs already
	}
	var out []Change
	for _, vol := range sortedKeys(w.intents) {
		it := w.intents[vol]
		if it.op != Attach || pending[vol] {
			continue
		}
		addReq, removeReq := o.requested(vol)
		if removeReq || !o.inVMSpec(vol) && !addReq {
			continue
		}
		if s := o.status(vol); s != nil && s.HotplugVolume != nil &&
			(s.HotplugVolume.AttachPodUID != "" || s.Phase == kubevirtv1.HotplugVolumeMounted || s.Phase == kubevirtv1.VolumeReady) {
			continue
		}
		out = append(out, Change{Volume: vol, Op: Detach})
		p.waits[vol] = waitFor{why: "withdrawn from the VM while its live migration starts, to be added again after it: its attachment pod had not started, and Longhorn attaches a volume asked for on two host nodes at once on neither"}
	}
	return out
}

// joinable says adds may be written while the VM still settles, to join the
// attachment pod KubeVirt is starting for the queue's last write. A change of
// the hotplug set replaces a pod that has not started (kubevirt v1.5.3
// pkg/virt-controller/watch/vmi/vmi.go:1673-1711, v1.7.0
// volume-hotplug.go:161), so a late add that joins costs the volumes in flight
// the time since that write, where waiting costs the add the rest of that
// pod's cycle and then a cycle of its own. Repeated faster than a pod starts,
// that replacement livelocks KubeVirt (kubevirt 16937); what keeps a join
// from it: at most one per cycle, within cfg.JoinWindow of the write that
// began the cycle. What keeps it from data: a set change resets the entries
// that are not Ready, and an entry reset after its disk was plugged is
// unplugged from the running domain (v1.5.3 vmi.go:2018-2063 with
// virtwrap/converter/converter.go:1615, v1.7.0 converter.go:1780), so a join
// needs every entry in flight to be an add whose pod has not started
// (phase at most AttachedToNode, which virt-controller writes once the pod
// exists, and no pod UID, which it writes once the pod runs: v1.7.0
// pkg/virt-controller/watch/vmi/storage.go:187-210), no removal of the VM
// under way or in the batch, and no device that may be gone.
func joinable(now time.Time, cfg Config, w *vmWork, o observed, pending map[string]bool, removes []Change) bool {
	if cfg.JoinWindow <= 0 || w.joined || w.cycleStart.IsZero() || now.Sub(w.cycleStart) >= cfg.JoinWindow {
		return false
	}
	if len(removes) > 0 || o.vm == nil || o.vmi == nil || o.vmi.Status.Phase != kubevirtv1.Running || o.deviceMayBeGone() || failing(o.vm) {
		return false
	}
	for vol := range pending {
		if w.expect[vol].op != Attach {
			return false
		}
	}
	for _, r := range o.vm.Status.VolumeRequests {
		if r.RemoveVolumeOptions != nil {
			return false
		}
	}
	for _, s := range o.vmi.Status.VolumeStatus {
		if s.HotplugVolume == nil {
			continue
		}
		if !o.inVMSpec(s.Name) {
			return false // on its way out
		}
		switch s.Phase {
		case kubevirtv1.VolumeReady:
			if s.Target == "" {
				return false
			}
		case "", kubevirtv1.VolumePending, kubevirtv1.VolumeBound, kubevirtv1.HotplugVolumeAttachedToNode:
			if s.HotplugVolume.AttachPodUID != "" {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// refuseOverLimit answers the adds that would take the VM past cfg.MaxDisks
// with a VMFullError and returns the others. KubeVirt's API server refuses
// the whole write of a VM over the limit, so writing such an add would fail
// the batch's other changes too. The count is the larger of the VM's disks
// and volumes (both lists are limited), with the adds KubeVirt has queued
// but not yet moved into the spec and this process's adds the informers do
// not show yet; removals written in the same batch go first and make room.
func (p *plan) refuseOverLimit(cfg Config, w *vmWork, o observed, pending map[string]bool, removes, adds []Change) []Change {
	limit := cfg.MaxDisks
	if limit <= 0 {
		limit = MaxVMDisks
	}
	used := o.diskCount() - len(removes)
	for vol := range pending {
		if w.expect[vol].op == Attach {
			used++
		}
	}
	kept := adds[:0:0]
	for _, c := range adds {
		if used < limit {
			used++
			kept = append(kept, c)
			continue
		}
		it := w.intents[c.Volume]
		p.resolve = append(p.resolve, resolution{it: it, err: &VMFullError{Volume: c.Volume, VM: it.vm, Disks: used, Limit: limit}})
	}
	return kept
}

// queuedBehind says how many volumes' changes a batch waits for: those
// KubeVirt is carrying out and this process's writes it has not shown yet.
func queuedBehind(o observed, pending map[string]bool) string {
	vols := map[string]bool{}
	for _, v := range o.unsettled() {
		vols[v] = true
	}
	for v := range pending {
		vols[v] = true
	}
	if len(vols) == 1 {
		return "queued behind 1 change KubeVirt is still carrying out on the VM"
	}
	return fmt.Sprintf("queued behind %d changes KubeVirt is still carrying out on the VM", len(vols))
}

// waitAll marks every change of the plan as waiting for why: the queue's
// own batching or pacing, which never wedges.
func (p *plan) waitAll(why string) {
	for _, c := range p.changes {
		p.waits[c.Volume] = waitFor{why: why}
	}
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
