package kubevirtsim

import (
	"context"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// virtHandler is virt-handler with its virt-launcher domains: it mounts
// hotplug volumes from the attachment pods into virt-launcher, has the
// domain plug and unplug the disks (the DiskHook), writes the node side of
// volumeStatus (volumestatus.go handlerPhase), starts the domain (phase
// Running) and shuts a deleted VMI down after its grace period.
type virtHandler struct {
	c      *cluster
	faults *Faults
	queue  workQueue

	mu      sync.Mutex
	domains map[types.UID]*domain
	passes  map[string]int  // per VMI key, for tests that wait for a pass
	paused  map[string]bool // test seam, as vmiController's
}

// domain is what virt-handler and the guest know about one VMI.
type domain struct {
	mounted  map[string]bool   // volume's device present in virt-launcher
	targets  map[string]string // volume -> disk target in the domain
	mountAt  deadlines         // AttachedToNode with a ready pod -> mounted
	attachAt deadlines         // MountedToPod -> the domain has the disk
	detachAt deadlines         // out of the spec -> unmounted
	shutdown time.Time         // when the deleted VMI's grace period ends
}

func newVirtHandler(c *cluster, f *Faults) *virtHandler {
	return &virtHandler{
		c: c, faults: f,
		queue:   newWorkQueue("handler", c.t.BackoffBase, c.t.HandlerPoll),
		domains: map[types.UID]*domain{},
		passes:  map[string]int{},
		paused:  map[string]bool{},
	}
}

func (h *virtHandler) register() {
	enqueue := func(key string) { h.queue.AddAfter(key, h.c.jit.d(h.c.t.VMIReconcile)) }
	_, _ = h.c.vmiInf.AddEventHandler(onEvent(func(obj any) { enqueue(objectKey(obj)) }))
	_, _ = h.c.podInf.AddEventHandler(onEvent(func(obj any) {
		if key := podVMIKey(obj); key != "" {
			enqueue(key)
		}
	}))
	_, _ = h.c.vmiInf.AddEventHandler(onDelete(func(obj any) {
		if vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance); ok {
			h.mu.Lock()
			delete(h.domains, vmi.UID)
			h.mu.Unlock()
		}
	}))
}

func (h *virtHandler) run(ctx context.Context) { h.queue.run(ctx, h.c, 3, h.sync) }
func (h *virtHandler) shutdown()               { h.queue.ShutDown() }

func (h *virtHandler) domainOf(uid types.UID) *domain {
	d := h.domains[uid]
	if d == nil {
		d = &domain{
			mounted: map[string]bool{}, targets: map[string]string{},
			mountAt: deadlines{}, attachAt: deadlines{}, detachAt: deadlines{},
		}
		h.domains[uid] = d
	}
	return d
}

// pass counts handler passes over a VMI; tests wait for a few to prove
// that a stuck entry stays stuck while virt-handler keeps looking at it.
func (h *virtHandler) pass(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.passes[key]
}

func (h *virtHandler) pause(key string, on bool) {
	h.mu.Lock()
	h.paused[key] = on
	h.mu.Unlock()
	if !on {
		h.queue.Add(key)
	}
}

// isMounted reports whether virt-handler has the volume mounted.
func (h *virtHandler) isMounted(vmi *kubevirtv1.VirtualMachineInstance, volume string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	d := h.domains[vmi.UID]
	return d != nil && d.mounted[volume]
}

// sync is one pass over one VMI. The domain's state lives under h.mu; the
// disk hooks run outside it.
func (h *virtHandler) sync(ctx context.Context, key string) (time.Duration, error) {
	vmi, ok := h.c.cachedVMI(key)
	if !ok {
		return 0, nil
	}
	if vmi.DeletionTimestamp != nil {
		return h.shutdownVMI(ctx, vmi)
	}
	if h.faults.isNotRunning(key) {
		if vmi.Status.Phase == kubevirtv1.Running {
			return 0, writeVolumeStatus(ctx, h.c, vmi, vmi.Status.VolumeStatus, kubevirtv1.Scheduled)
		}
		return 0, nil
	}
	if vmi.Status.Phase != kubevirtv1.Scheduled && vmi.Status.Phase != kubevirtv1.Running {
		return 0, nil
	}
	h.mu.Lock()
	paused := h.paused[key]
	if !paused {
		h.passes[key]++
	}
	h.mu.Unlock()
	if paused {
		return 0, nil
	}

	n := node{h: h, vmi: vmi, now: time.Now(), entries: vmi.Status.DeepCopy().VolumeStatus}
	n.mountAndUnmount(ctx)
	n.setPhases()
	n.attachToDomain(ctx)
	n.setPhases()

	phase := vmi.Status.Phase
	if phase == kubevirtv1.Scheduled && (!h.c.feat.waitHotplugBeforeStart || hotplugVolumesReady(vmi, n.entries)) {
		phase = kubevirtv1.Running
		h.c.log.V(2).Info("VMI running", "vm", key)
	}
	if err := writeVolumeStatus(ctx, h.c, vmi, n.entries, phase); err != nil {
		return 0, err
	}
	// virt-handler looks again every second while a hotplug entry has no
	// target yet (v1.7.0 pkg/virt-handler/vm.go:652).
	if slices.ContainsFunc(n.entries, func(e kubevirtv1.VolumeStatus) bool { return e.HotplugVolume != nil && e.Target == "" }) {
		n.soon(h.c.t.HandlerPoll)
	}
	return n.wake, nil
}

// node is one handler pass over one VMI.
type node struct {
	h       *virtHandler
	vmi     *kubevirtv1.VirtualMachineInstance
	now     time.Time
	entries []kubevirtv1.VolumeStatus
	wake    time.Duration
}

func (n *node) soon(d time.Duration) {
	d = max(d, time.Millisecond)
	if n.wake == 0 || d < n.wake {
		n.wake = d
	}
}

// mountAndUnmount mounts every hotplug volume of the spec whose entry names
// a running attachment pod (v1.7.0 pkg/virt-handler/hotplug-disk/mount.go:330
// mountFromPod) and, for volumes that left the spec, has the guest drop the
// disk and unmounts it after Timings.Detach (mount.go:630 Unmount). Once
// mounted a volume stays mounted whatever pod its entry names later:
// IsMounted looks at virt-launcher only (mount.go:809).
func (n *node) mountAndUnmount(ctx context.Context) {
	h, t := n.h, n.h.c.t
	vmKey := n.vmi.Namespace + "/" + n.vmi.Name
	pods := h.c.attachmentPods(n.vmi)
	running := func(uid types.UID) bool {
		return uid != "" && slices.ContainsFunc(pods, func(p *corev1.Pod) bool { return p.UID == uid && p.Status.Phase == corev1.PodRunning })
	}
	h.mu.Lock()
	d := h.domainOf(n.vmi.UID)
	var unplug []string
	for _, e := range n.entries {
		if e.HotplugVolume == nil || !HasVolume(n.vmi.Spec.Volumes, e.Name) {
			continue
		}
		delete(d.detachAt, e.Name) // back in the spec before it was unmounted
		if d.mounted[e.Name] {
			continue
		}
		if !running(e.HotplugVolume.AttachPodUID) {
			delete(d.mountAt, e.Name)
			continue
		}
		if at := d.mountAt.at(e.Name, n.now, t.Mount, h.c.jit); n.now.Before(at) {
			n.soon(at.Sub(n.now))
			continue
		}
		delete(d.mountAt, e.Name)
		d.mounted[e.Name] = true
	}
	for _, name := range domainVolumes(d) {
		if HasVolume(n.vmi.Spec.Volumes, name) {
			continue
		}
		if _, ok := d.targets[name]; ok {
			unplug = append(unplug, name)
		}
	}
	h.mu.Unlock()

	for _, name := range unplug { // the guest loses the disk first
		if err := h.unplug(ctx, vmKey, name); err != nil {
			h.c.log.Info("disk hook Unplug failed, retrying", "vm", vmKey, "volume", name, "err", err)
			n.soon(t.HandlerPoll)
			continue
		}
		h.mu.Lock()
		delete(d.targets, name)
		h.mu.Unlock()
	}

	h.mu.Lock()
	defer h.mu.Unlock()
	for _, name := range domainVolumes(d) {
		if HasVolume(n.vmi.Spec.Volumes, name) || !d.mounted[name] {
			continue
		}
		if _, attached := d.targets[name]; attached {
			continue // Unplug failed: retried above
		}
		delete(d.attachAt, name)
		if at := d.detachAt.at(name, n.now, t.Detach, h.c.jit); n.now.Before(at) {
			n.soon(at.Sub(n.now))
			continue
		}
		delete(d.detachAt, name)
		delete(d.mounted, name)
		h.c.log.V(2).Info("volume unmounted", "vm", vmKey, "volume", name)
	}
}

// domainVolumes lists the volumes the domain or virt-launcher still has.
func domainVolumes(d *domain) []string {
	var out []string
	for name := range d.mounted {
		out = append(out, name)
	}
	for name := range d.targets {
		if !d.mounted[name] {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// setPhases writes the targets and phases the node shows.
func (n *node) setPhases() {
	n.h.mu.Lock()
	defer n.h.mu.Unlock()
	d := n.h.domainOf(n.vmi.UID)
	for i := range n.entries {
		e := &n.entries[i]
		if e.HotplugVolume == nil {
			continue
		}
		e.Target = d.targets[e.Name]
		handlerPhase(e, HasVolume(n.vmi.Spec.Volumes, e.Name), d.mounted[e.Name])
	}
}

// attachToDomain has the domain take the disks of mounted volumes whose
// entry is MountedToPod or Ready (v1.7.0
// pkg/virt-launcher/virtwrap/converter/converter.go:1780), Timings.
// DomainAttach after it first could; DiskHook.Plug runs just before.
func (n *node) attachToDomain(ctx context.Context) {
	h := n.h
	vmKey := n.vmi.Namespace + "/" + n.vmi.Name
	h.mu.Lock()
	d := h.domainOf(n.vmi.UID)
	used := map[string]bool{}
	for _, e := range n.entries {
		if e.Target != "" {
			used[e.Target] = true
		}
	}
	for _, t := range d.targets {
		used[t] = true
	}
	var due []string
	for _, e := range n.entries {
		name := e.Name
		if e.HotplugVolume == nil || !HasVolume(n.vmi.Spec.Volumes, name) || !d.mounted[name] {
			delete(d.attachAt, name)
			continue
		}
		if _, attached := d.targets[name]; attached {
			continue
		}
		// The deadline runs from the first pass that could attach and is
		// kept while the volume stays mounted: an entry virt-controller
		// flips back to its PVC phase for a moment still gets its disk.
		at := d.attachAt.at(name, n.now, h.c.t.DomainAttach, h.c.jit)
		if e.Phase != kubevirtv1.HotplugVolumeMounted && e.Phase != kubevirtv1.VolumeReady {
			continue
		}
		if n.now.Before(at) {
			n.soon(at.Sub(n.now))
			continue
		}
		due = append(due, name)
	}
	h.mu.Unlock()

	for _, name := range due {
		claim := ""
		if v, ok := volumeNamed(n.vmi.Spec.Volumes, name); ok {
			claim = volumeClaim(v)
		}
		if err := h.plug(ctx, vmKey, name, claim); err != nil {
			h.c.log.Info("disk hook Plug failed, retrying", "vm", vmKey, "volume", name, "err", err)
			n.soon(h.c.t.HandlerPoll)
			continue
		}
		disk, _ := diskNamed(n.vmi.Spec.Domain.Devices.Disks, name)
		h.mu.Lock()
		d.targets[name] = nextTarget(&disk, used)
		delete(d.attachAt, name)
		h.mu.Unlock()
		h.c.log.V(1).Info("volume plugged into the guest", "vm", vmKey, "volume", name)
	}
}

// shutdownVMI lets a deleted VMI live for its termination grace period
// (spec.terminationGracePeriodSeconds, 30 s by default: v1.7.0
// staging/src/kubevirt.io/api/core/v1/types.go:39, enforced by
// pkg/virt-handler/vm.go:1557 hasGracePeriodExpired; a guest that honours
// ACPI may go sooner, this one never does), scaled by Options.Scale; then
// it unplugs its disks, deletes its attachment pods and drops its
// finalizer.
func (h *virtHandler) shutdownVMI(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) (time.Duration, error) {
	grace := kubevirtv1.DefaultGracePeriodSeconds
	if g := vmi.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = *g
	}
	now := time.Now()
	h.mu.Lock()
	d := h.domainOf(vmi.UID)
	if d.shutdown.IsZero() {
		d.shutdown = now.Add(time.Duration(float64(time.Duration(grace)*time.Second) * h.c.opts.Scale))
	}
	at := d.shutdown
	plugged := make([]string, 0, len(d.targets))
	for name := range d.targets {
		plugged = append(plugged, name)
	}
	h.mu.Unlock()
	if now.Before(at) {
		return at.Sub(now), nil
	}
	vmKey := vmi.Namespace + "/" + vmi.Name
	for _, name := range plugged {
		if err := h.unplug(ctx, vmKey, name); err != nil {
			h.c.log.Info("disk hook Unplug failed at shutdown, retrying", "vm", vmKey, "volume", name, "err", err)
			return h.c.t.HandlerPoll, nil
		}
		h.mu.Lock()
		delete(d.targets, name)
		h.mu.Unlock()
	}
	for _, p := range h.c.attachmentPods(vmi) {
		if p.DeletionTimestamp == nil {
			if err := deleteAttachmentPod(ctx, h.c, p); err != nil {
				return 0, err
			}
		}
	}
	if !slices.Contains(vmi.Finalizers, vmiFinalizer) {
		return 0, nil
	}
	keep := slices.DeleteFunc(slices.Clone(vmi.Finalizers), func(f string) bool { return f == vmiFinalizer })
	patch, err := casPatch(casOp{"/metadata/finalizers", vmi.Finalizers, keep, true})
	if err != nil {
		return 0, err
	}
	if err := h.c.kv.patch(ctx, resVMIs, vmi.Namespace, vmi.Name, "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachineInstance{}); err != nil && !apierrors.IsNotFound(err) {
		return 0, err
	}
	h.c.log.V(2).Info("VMI shut down", "vm", vmKey)
	return 0, nil
}

func (h *virtHandler) plug(ctx context.Context, vm, volume, claim string) error {
	if h.c.opts.DiskHook == nil {
		return nil
	}
	return h.c.opts.DiskHook.Plug(ctx, vm, volume, claim)
}

func (h *virtHandler) unplug(ctx context.Context, vm, volume string) error {
	if h.c.opts.DiskHook == nil {
		return nil
	}
	return h.c.opts.DiskHook.Unplug(ctx, vm, volume)
}
