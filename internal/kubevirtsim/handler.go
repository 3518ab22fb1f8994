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

	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt/podview"
	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// virtHandler drives virt-handler (internal/virthandler, the same model the
// real control plane's node agents run) from the simulator's informers: it
// hands each pass the VMI and its attachment pods, writes the volumeStatus
// and phase the pass answers (the domain starts once the hotplug volumes
// are ready), records its Events, and shuts a deleted VMI down after its
// grace period.
type virtHandler struct {
	c      *cluster
	faults *Faults
	queue  workQueue
	vh     *virthandler.Handler

	mu     sync.Mutex
	passes map[string]int  // per VMI key, for tests that wait for a pass
	paused map[string]bool // test seam, as vmiController's
}

func newVirtHandler(c *cluster, f *Faults) *virtHandler {
	rel, _ := virthandler.ForVersion(string(c.opts.Version)) // checked by setDefaults
	t := virthandler.Timings{
		Mount: c.t.Mount, DomainAttach: c.t.DomainAttach, Unplug: c.t.Detach, Poll: c.t.HandlerPoll,
	}
	d := virthandler.DefaultTimings().Scaled(c.opts.Scale)
	t.IOErrorWait, t.IOErrorMaxWait, t.IOErrorWindow = d.IOErrorWait, d.IOErrorMaxWait, d.IOErrorWindow
	return &virtHandler{
		c: c, faults: f,
		// virt-handler's queue is client-go's default controller rate
		// limiter, 5 ms doubling to 1000 s per key (v1.7.0
		// pkg/virt-handler/vm.go:145).
		queue:  newWorkQueue("handler", c.t.BackoffBase, c.t.BackoffMax),
		vh:     virthandler.New(rel, t, c.jit.d, diskHook{c.opts.DiskHook}, c.log.WithName("virt-handler")),
		passes: map[string]int{},
		paused: map[string]bool{},
	}
}

// diskHook adapts Options.DiskHook (nil: no-op).
type diskHook struct{ h DiskHook }

func (d diskHook) Plug(ctx context.Context, vm, volume, claim string) error {
	if d.h == nil {
		return nil
	}
	return d.h.Plug(ctx, vm, volume, claim)
}

func (d diskHook) Unplug(ctx context.Context, vm, volume string) error {
	if d.h == nil {
		return nil
	}
	return d.h.Unplug(ctx, vm, volume)
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
			h.vh.Forget(vmi.UID)
		}
	}))
}

func (h *virtHandler) run(ctx context.Context) { h.queue.run(ctx, h.c, 3, h.sync) }
func (h *virtHandler) shutdown()               { h.queue.ShutDown() }

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
	return h.vh.Mounted(vmi.UID, volume)
}

// sync is one pass over one VMI.
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
	if isMigrating(vmi) {
		// virt-handler ignores a VMI while it migrates (v1.7.0
		// pkg/virt-handler/vm.go:391-394, controller.go:308-315): no
		// hotplug is mounted or unplugged until it runs on the target.
		return 0, nil
	}

	res := h.vh.Sync(ctx, vmi, h.handlerPods(h.c.attachmentPods(vmi)), time.Now())
	if err := virthandler.RecordEvents(ctx, h.c.kube, vmi, res.Events); err != nil {
		h.c.log.V(2).Info("virt-handler events not recorded", "vm", key, "err", err)
	}
	if res.Entries == nil { // delayed: nothing written
		return res.Wake, nil
	}
	phase := vmi.Status.Phase
	if phase == kubevirtv1.Scheduled && (!h.c.feat.waitHotplugBeforeStart || hotplugVolumesReady(vmi, res.Entries)) {
		phase = kubevirtv1.Running
		h.c.log.V(2).Info("VMI running", "vm", key)
	}
	st := vmi.Status.DeepCopy()
	st.VolumeStatus, st.Phase = res.Entries, phase
	st.Conditions = virthandler.PausedCondition(st.Conditions, res.PausedIOError, time.Now())
	if err := writeVMIStatus(ctx, h.c, vmi, st); err != nil {
		return 0, err
	}
	if res.Err != nil {
		// The failed pass goes back rate-limited; the poll of an entry
		// without a target still comes (vm.go:652 and :1494).
		if res.Wake > 0 {
			h.queue.AddAfter(key, res.Wake)
		}
		return 0, res.Err
	}
	return res.Wake, nil
}

// handlerPods is what virt-handler finds of each attachment pod on the
// node: its UID and the volumes it holds; with real kubelets only those
// the host kubelet published (podview.HandlerPod, as on the real
// control plane). The simulator's own kubelet publishes a pod's volumes as
// it starts it, and virt-controller names a pod to virt-handler only once
// it runs.
func (h *virtHandler) handlerPods(pods []*corev1.Pod) []virthandler.Pod {
	out := make([]virthandler.Pod, 0, len(pods))
	for _, p := range pods {
		if h.c.opts.Kubelets {
			out = append(out, podview.HandlerPod(p))
			continue
		}
		out = append(out, virthandler.Pod{UID: p.UID, Volumes: podVolumes(p)})
	}
	return out
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
	at := h.vh.ShutdownAt(vmi.UID, now, time.Duration(float64(time.Duration(grace)*time.Second)*h.c.opts.Scale))
	if now.Before(at) {
		return at.Sub(now), nil
	}
	vmKey := vmi.Namespace + "/" + vmi.Name
	if err := h.vh.Shutdown(ctx, vmi); err != nil {
		h.c.log.Info("disk hook Unplug failed at shutdown, retrying", "vm", vmKey, "err", err)
		return h.c.t.HandlerPoll, nil
	}
	for _, p := range h.c.attachmentPods(vmi) {
		if p.DeletionTimestamp == nil {
			if err := deleteAttachmentPod(ctx, h.c, p); err != nil {
				return 0, err
			}
		}
	}
	if err := deleteLauncher(ctx, h.c, vmi); err != nil {
		return 0, err
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
