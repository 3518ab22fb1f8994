package virthandler

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// DiskHook follows a volume into and out of the guest: vm is
// "namespace/name". Plug runs as the domain takes the disk, Unplug as it lets
// it go; an error fails the pass, as a failed domain sync does.
type DiskHook interface {
	Plug(ctx context.Context, vm, volume, claimName string) error
	Unplug(ctx context.Context, vm, volume string) error
}

// Pod is an attachment pod of the VMI as virt-handler finds it on the node.
type Pod struct {
	UID     types.UID
	Volumes []string
}

// Event is an Event virt-handler records on the VMI.
type Event struct {
	Reason, Message string
}

// Event reasons (v1.7.0 pkg/virt-handler/vm.go:1995 and :1478).
const (
	ReasonHotplugFailed = "HotplugFailed"
	ReasonSyncFailed    = "SyncFailed"
)

// Result is one pass over one VMI.
type Result struct {
	// Entries is the volumeStatus to write. Nil when the pass was delayed
	// (an I/O-error pause): virt-handler writes nothing then.
	Entries []kubevirtv1.VolumeStatus
	// Err is the pass's failure: the status is still written, then the key
	// goes back to the rate-limited queue (vm.go:1477-1495).
	Err error
	// Wake asks for another pass after this long (0: none needed).
	Wake time.Duration
	// Events are the Events of the pass, HotplugFailed and SyncFailed.
	Events []Event
	// PausedIOError says the domain was paused on an I/O error as the pass
	// found it (a plugged disk whose device vanished): the status written
	// with Entries carries the Paused condition (PausedCondition).
	PausedIOError bool
}

// Handler is virt-handler's hotplug part on one host for every VMI: what
// it has mounted into each virt-launcher, what each domain has plugged, and
// its mount records. The transport (informers, status writes, queues) is
// the caller's.
type Handler struct {
	rel    Release
	t      Timings
	jitter func(time.Duration) time.Duration
	disks  DiskHook
	faults *Faults
	log    klog.Logger

	mu      sync.Mutex
	domains map[types.UID]*domain
}

// New returns a handler. jitter spreads a stage's latency (nil: exact);
// disks may be nil.
func New(rel Release, t Timings, jitter func(time.Duration) time.Duration, disks DiskHook, log klog.Logger) *Handler {
	if jitter == nil {
		jitter = func(d time.Duration) time.Duration { return d }
	}
	return &Handler{rel: rel, t: t, jitter: jitter, disks: disks, faults: newFaults(), log: log, domains: map[types.UID]*domain{}}
}

// Release is the release the handler plays.
func (h *Handler) Release() Release { return h.rel }

// Faults are the host faults the handler reacts to.
func (h *Handler) Faults() *Faults { return h.faults }

// domain is what virt-handler and the domain of one VMI hold.
type domain struct {
	mounted map[string]bool   // device present in virt-launcher
	record  []string          // the mount record, in mount order (mount.go:286)
	targets map[string]string // disks the domain has
	// Stage deadlines per volume.
	mountAt, attachAt, unplugAt map[string]time.Time
	io                          ioRetry
	shutdown                    time.Time
}

func (h *Handler) domainOf(uid types.UID) *domain {
	d := h.domains[uid]
	if d == nil {
		d = &domain{
			mounted: map[string]bool{}, targets: map[string]string{},
			mountAt: map[string]time.Time{}, attachAt: map[string]time.Time{}, unplugAt: map[string]time.Time{},
		}
		h.domains[uid] = d
	}
	return d
}

// deadline returns the deadline of key in m, starting it now if none runs.
func (h *Handler) deadline(m map[string]time.Time, key string, now time.Time, d time.Duration) time.Time {
	at, ok := m[key]
	if !ok {
		at = now.Add(h.jitter(d))
		m[key] = at
	}
	return at
}

// Forget drops a VMI that is gone.
func (h *Handler) Forget(uid types.UID) {
	h.mu.Lock()
	delete(h.domains, uid)
	h.mu.Unlock()
}

// Mounted reports whether the volume's device is in the VMI's
// virt-launcher.
func (h *Handler) Mounted(uid types.UID, volume string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	d := h.domains[uid]
	return d != nil && d.mounted[volume]
}

// pass is one pass's working state; it runs under h.mu except around the
// disk hooks.
type pass struct {
	h       *Handler
	ctx     context.Context
	vmi     *kubevirtv1.VirtualMachineInstance
	key     string
	d       *domain
	now     time.Time
	pods    []Pod
	entries []kubevirtv1.VolumeStatus
	res     Result
}

func (p *pass) soon(d time.Duration) {
	d = max(d, time.Millisecond)
	if p.res.Wake == 0 || d < p.res.Wake {
		p.res.Wake = d
	}
}

func (p *pass) inSpec(name string) bool {
	return slices.ContainsFunc(p.vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == name })
}

// Sync is one pass over a running VMI, in virt-handler's order (v1.7.0
// vm.go:1932 vmUpdateHelperDefault): mount from the attachment pods, sync
// the domain (unplug removed disks, plug mounted ones), unmount what left
// the spec (handleHousekeeping, vm.go:2140), then the status. The status
// reports the targets of the domain as the pass found it (vm.go:1488 hands
// the domain read before the sync to updateVMIStatus); the domain's event
// brings the next pass.
func (h *Handler) Sync(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, pods []Pod, now time.Time) Result {
	h.mu.Lock()
	defer h.mu.Unlock()
	p := &pass{h: h, ctx: ctx, vmi: vmi, key: vmi.Namespace + "/" + vmi.Name, d: h.domainOf(vmi.UID), now: now, pods: pods,
		entries: vmi.Status.DeepCopy().VolumeStatus}
	p.res.PausedIOError = p.pausedOnIOError()
	if delay, ok := p.ioErrorDelay(p.res.PausedIOError); ok {
		h.log.Info("domain paused on an I/O error: delaying the VMI update", "vm", p.key, "delay", delay)
		return Result{Wake: delay, PausedIOError: true}
	}
	seen := maps.Clone(p.d.targets)
	err := p.mount()
	if err == nil {
		err = p.syncDomain()
	}
	if err == nil {
		err = p.unmount()
	}
	if err != nil {
		p.res.Err = err
		p.res.Events = append(p.res.Events, Event{Reason: ReasonSyncFailed, Message: err.Error()})
		h.log.Info("virt-handler pass failed", "vm", p.key, "err", err)
	}
	if !maps.Equal(seen, p.d.targets) {
		p.soon(time.Millisecond) // the domain event
	}
	p.status(seen)
	return p.res
}

// errNotExist marks a mount whose source is missing: the only mount error
// virt-handler tolerates from v1.6.0 on.
var errNotExist = fs.ErrNotExist

// mount is mountFromPod (v1.7.0 mount.go:330-352): it walks the status
// entries in name order and returns at the first failure.
func (p *pass) mount() error {
	rel := p.h.rel
	var source types.UID
	for _, e := range p.entries {
		if e.HotplugVolume == nil {
			continue
		}
		inSpec := p.inSpec(e.Name)
		if !inSpec && !rel.RemountRemoved {
			continue
		}
		uid := e.HotplugVolume.AttachPodUID
		if rel.FirstUIDReuse {
			if source == "" {
				source = uid
			}
			uid = source
		}
		if uid == "" || p.d.mounted[e.Name] {
			// No source yet, or the device is already in virt-launcher:
			// mountBlockHotplugVolume looks nothing up (mount.go:408).
			continue
		}
		if err := p.lookup(uid, e.Name); err != nil {
			if !errors.Is(err, errNotExist) || rel.MountErrorFailsPass {
				return err
			}
			p.res.Events = append(p.res.Events, Event{Reason: ReasonHotplugFailed, Message: err.Error()})
			p.h.log.Info("HotplugFailed", "vm", p.key, "volume", e.Name, "err", err)
			p.soon(p.h.t.Poll)
			return nil
		}
		if inSpec {
			if at := p.h.deadline(p.d.mountAt, e.Name, p.now, p.h.t.Mount); p.now.Before(at) {
				p.soon(at.Sub(p.now))
				continue
			}
			delete(p.d.mountAt, e.Name)
		} else {
			p.h.log.V(2).Info("removed volume mounted again from its old attachment pod", "vm", p.key, "volume", e.Name, "pod", uid)
		}
		p.d.mounted[e.Name] = true
		if !slices.Contains(p.d.record, e.Name) {
			p.d.record = append(p.d.record, e.Name)
		}
	}
	return nil
}

// lookup finds the volume's device in the source pod (mount.go:448
// getSourceMajorMinor): a pod without the volume is not-exist; a pod whose
// device vanished has the directory but no device in it (mount.go:103).
func (p *pass) lookup(uid types.UID, volume string) error {
	i := slices.IndexFunc(p.pods, func(pod Pod) bool { return pod.UID == uid })
	if i < 0 || !slices.Contains(p.pods[i].Volumes, volume) {
		return fmt.Errorf("failed to mount block hotplug volume %s: attachment pod %s has no device for it: %w", volume, uid, errNotExist)
	}
	if p.h.faults.vanished(p.key, volume) {
		return fmt.Errorf("failed to mount block hotplug volume %s: no device in /pods/%s/volumes/kubernetes.io~empty-dir/hotplug-disks/%s", volume, uid, volume)
	}
	return nil
}

// syncDomain is the domain sync (SyncVirtualMachine): disks of volumes out
// of the spec go first, then mounted volumes whose entry is MountedToPod or
// Ready get theirs (v1.7.0 pkg/virt-launcher/virtwrap/converter/
// converter.go:1777-1784). A hook error fails the pass.
func (p *pass) syncDomain() error {
	for _, name := range sortedKeys(p.d.targets) {
		if p.inSpec(name) {
			continue
		}
		if at := p.h.deadline(p.d.unplugAt, name, p.now, p.h.t.Unplug); p.now.Before(at) {
			p.soon(at.Sub(p.now))
			continue
		}
		if err := p.unlocked(func() error { return p.h.unplug(p.ctx, p.key, name) }); err != nil {
			return fmt.Errorf("domain detach of %s: %w", name, err)
		}
		delete(p.d.targets, name)
		delete(p.d.unplugAt, name)
		p.h.log.V(1).Info("volume unplugged from the guest", "vm", p.key, "volume", name)
	}
	// The domain spec holds a hotplug disk only while its entry is
	// MountedToPod or Ready (converter.go:1780), and the domain sync
	// detaches every disk the spec lacks (manager.go:1363): an entry
	// virt-controller reset to its PVC phase (a set change with no current
	// pod, before virt-handler wrote Ready for a disk it just attached)
	// loses its disk, to get it again once the stale target makes it Ready.
	for _, e := range p.entries {
		if _, plugged := p.d.targets[e.Name]; !plugged || e.HotplugVolume == nil || !p.inSpec(e.Name) || domainReady(e.Phase) {
			continue
		}
		name := e.Name
		if err := p.unlocked(func() error { return p.h.unplug(p.ctx, p.key, name) }); err != nil {
			return fmt.Errorf("domain detach of %s: %w", name, err)
		}
		delete(p.d.targets, name)
		p.h.log.Info("disk detached from the domain: its entry went back to its PVC phase", "vm", p.key, "volume", name, "phase", e.Phase)
	}
	used := map[string]bool{}
	for _, t := range p.d.targets {
		used[t] = true
	}
	for _, e := range p.entries {
		name := e.Name
		if e.HotplugVolume == nil || !p.inSpec(name) || !p.d.mounted[name] {
			delete(p.d.attachAt, name)
			continue
		}
		if _, ok := p.d.targets[name]; ok {
			continue
		}
		// The deadline runs from the first pass that could attach and is
		// kept while the volume stays mounted: an entry virt-controller
		// flips back to its PVC phase for a moment still gets its disk.
		at := p.h.deadline(p.d.attachAt, name, p.now, p.h.t.DomainAttach)
		if !domainReady(e.Phase) {
			continue
		}
		if p.now.Before(at) {
			p.soon(at.Sub(p.now))
			continue
		}
		claim := claimOf(p.vmi.Spec.Volumes, name)
		if err := p.unlocked(func() error { return p.h.plug(p.ctx, p.key, name, claim) }); err != nil {
			return fmt.Errorf("domain attach of %s: %w", name, err)
		}
		p.d.targets[name] = nextTarget(p.vmi, name, used)
		delete(p.d.attachAt, name)
		p.h.log.V(1).Info("volume plugged into the guest", "vm", p.key, "volume", name)
	}
	return nil
}

// domainReady: the converter puts a hotplug disk in the domain spec
// (v1.7.0 converter.go:1780, v1.5.2 :1615, v1.9.0 :1174).
func domainReady(p kubevirtv1.VolumePhase) bool {
	return p == kubevirtv1.HotplugVolumeMounted || p == kubevirtv1.VolumeReady
}

// unmount is Unmount (v1.7.0 mount.go:630-729): every record path of a
// volume out of the spec whose disk the domain let go is unmounted.
func (p *pass) unmount() error {
	var failed []string
	keep := p.d.record[:0:0]
	for i, name := range p.d.record {
		if p.inSpec(name) || !p.d.mounted[name] {
			if p.d.mounted[name] {
				keep = append(keep, name)
			}
			continue
		}
		if _, plugged := p.d.targets[name]; plugged {
			keep = append(keep, name)
			continue
		}
		if p.h.faults.unmountFails(p.key, name) {
			err := fmt.Errorf("failed to unmount hotplug volume %s: removing its device rule failed", name)
			if p.h.rel.UnmountStopsAtFirstFailure {
				// The record is not saved: the paths after this one stay
				// mounted and recorded.
				return err
			}
			failed = append(failed, name)
			keep = append(keep, name)
			continue
		}
		delete(p.d.mounted, name)
		p.h.log.V(2).Info("volume unmounted", "vm", p.key, "volume", name, "record", i)
	}
	p.d.record = keep
	if len(failed) > 0 {
		return fmt.Errorf("failed to unmount %d hotplug volume path(s): %v", len(failed), failed)
	}
	return nil
}

// status is updateHotplugVolumeStatus (v1.7.0 vm.go:474) over every
// hotplug entry, with the targets the pass started from.
func (p *pass) status(targets map[string]string) {
	needsRefresh := false
	for i := range p.entries {
		e := &p.entries[i]
		if e.HotplugVolume == nil {
			continue
		}
		e.Target = targets[e.Name]
		Phase(e, p.inSpec(e.Name), p.d.mounted[e.Name])
		needsRefresh = needsRefresh || e.Target == ""
	}
	if needsRefresh {
		p.soon(p.h.t.Poll)
	}
	p.res.Entries = p.entries
}

// unlocked runs a disk hook without the handler's lock.
func (p *pass) unlocked(f func() error) error {
	p.h.mu.Unlock()
	defer p.h.mu.Lock()
	return f()
}

func (h *Handler) plug(ctx context.Context, vm, volume, claim string) error {
	if h.disks == nil {
		return nil
	}
	return h.disks.Plug(ctx, vm, volume, claim)
}

func (h *Handler) unplug(ctx context.Context, vm, volume string) error {
	if h.disks == nil {
		return nil
	}
	return h.disks.Unplug(ctx, vm, volume)
}

// Shutdown unplugs every disk of a stopping VMI's domain and forgets its
// mounts: a domain that ends takes its hot-plugged disks with it. It stops
// at the first hook error, for a later call to finish.
func (h *Handler) Shutdown(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	key := vmi.Namespace + "/" + vmi.Name
	h.mu.Lock()
	d := h.domainOf(vmi.UID)
	plugged := sortedKeys(d.targets)
	h.mu.Unlock()
	for _, name := range plugged {
		if err := h.unplug(ctx, key, name); err != nil {
			return fmt.Errorf("VMI %s: disk %s not unplugged: %w", key, name, err)
		}
		h.mu.Lock()
		delete(d.targets, name)
		h.mu.Unlock()
	}
	h.mu.Lock()
	d.mounted, d.record = map[string]bool{}, nil
	h.mu.Unlock()
	return nil
}

// ShutdownAt returns when a deleted VMI's grace period ends, starting it
// now at the first call.
func (h *Handler) ShutdownAt(uid types.UID, now time.Time, grace time.Duration) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	d := h.domainOf(uid)
	if d.shutdown.IsZero() {
		d.shutdown = now.Add(grace)
	}
	return d.shutdown
}
