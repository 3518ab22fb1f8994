package kubevirtsim

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// vmiController is virt-controller's VMI controller: it schedules a new VMI
// (phase Scheduled, node, interfaces, the boot volumes), keeps one
// attachment pod (hp-volume-xxxxx) per VMI holding its whole hotplug set,
// and writes the attach and detach side of volumeStatus (volumestatus.go).
type vmiController struct {
	c      *cluster
	faults *Faults
	queue  workQueue

	mu sync.Mutex
	// expect holds, per VMI, the attachment pods created and not yet seen
	// in the cache: like KubeVirt's pod expectations (v1.7.0
	// pkg/virt-controller/watch/vmi/vmi.go:314), no pass runs on a cache
	// that misses them, or it would create them again.
	expect map[types.UID]map[string]time.Time
	// syncErr is the last hotplug error per VMI key, as KubeVirt logs it
	// (its status update is a patch that carries no condition).
	syncErr map[string]string
	// paused VMIs are skipped: a test seam to land a change inside a window
	// that is otherwise a few milliseconds wide.
	paused map[string]bool
	// afterWrite, when set, sees every volumeStatus this controller wrote
	// (test seam: it may pause the VMI right there).
	afterWrite atomic.Pointer[func(key string, entries []kubevirtv1.VolumeStatus)]
}

func newVMIController(c *cluster, f *Faults) *vmiController {
	return &vmiController{
		c: c, faults: f,
		queue:   newWorkQueue("vmi", c.t.BackoffBase, c.t.BackoffMax),
		expect:  map[types.UID]map[string]time.Time{},
		syncErr: map[string]string{},
		paused:  map[string]bool{},
	}
}

func (v *vmiController) register() {
	enqueue := func(key string) { v.queue.AddAfter(key, v.c.jit.d(v.c.t.VMIReconcile)) }
	_, _ = v.c.vmiInf.AddEventHandler(onEvent(func(obj any) { enqueue(objectKey(obj)) }))
	_, _ = v.c.podInf.AddEventHandler(onEvent(func(obj any) {
		if key := podVMIKey(obj); key != "" {
			enqueue(key)
		}
	}))
	_, _ = v.c.pvcInf.AddEventHandler(onEvent(func(obj any) {
		if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok {
			v.c.eachVMIIn(pvc.Namespace, enqueue)
		}
	}))
	_, _ = v.c.vmiInf.AddEventHandler(onDelete(func(obj any) {
		if vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance); ok {
			v.mu.Lock()
			delete(v.expect, vmi.UID)
			v.mu.Unlock()
		}
	}))
}

func (v *vmiController) run(ctx context.Context) { v.queue.run(ctx, v.c, 3, v.sync) }
func (v *vmiController) shutdown()               { v.queue.ShutDown() }

func podVMIKey(obj any) string {
	p, ok := unwrap(obj).(*corev1.Pod)
	if !ok || p.Labels[labelAttachmentPodVMI] == "" {
		return ""
	}
	return p.Namespace + "/" + p.Labels[labelAttachmentPodVMI]
}

// sync is one pass over one VMI.
func (v *vmiController) sync(ctx context.Context, key string) (time.Duration, error) {
	vmi, ok := v.c.cachedVMI(key)
	if !ok {
		v.deleteOrphans(ctx, key)
		return 0, nil
	}
	if vmi.DeletionTimestamp != nil || v.faults.isNotRunning(key) || v.isPaused(key) {
		return 0, nil // virt-handler shuts a deleted VMI down
	}
	st := vmi.Status.DeepCopy()
	switch st.Phase {
	case "", kubevirtv1.Pending:
		// The pass that creates the virt-launcher pod writes Pending, the
		// next, which finds the pod not yet running, Scheduling (v1.7.0
		// pkg/virt-controller/watch/vmi/lifecycle.go:280-288 and 331): two
		// writes a watcher sees before Scheduled.
		st.Phase = kubevirtv1.Scheduling
		if vmi.Status.Phase == "" {
			st.Phase = kubevirtv1.Pending
			if v.c.opts.Kubelets {
				if err := v.ensureLauncher(ctx, vmi); err != nil {
					return 0, err
				}
			}
		}
		v.setActivePods(vmi, st)
		return 0, writeVMIStatus(ctx, v.c, vmi, st)
	case kubevirtv1.Scheduling:
		node := ""
		if v.c.opts.Kubelets {
			// Scheduled once the scheduler placed the launcher and its
			// kubelet runs it; the pod's events bring the VMI back.
			l := v.c.launcherRunning(vmi)
			if l == nil {
				return 0, v.ensureLauncher(ctx, vmi)
			}
			node = l.Spec.NodeName
		}
		v.schedule(vmi, st, node)
	case kubevirtv1.Scheduled, kubevirtv1.Running:
	default:
		return 0, nil // Succeeded, Failed, Unknown: nothing to do
	}
	if err := v.sweepOtherNodes(ctx, vmi); err != nil {
		return 0, err
	}
	pods := v.c.attachmentPods(vmi)
	if !v.expectationsMet(vmi.UID, pods) {
		return 10 * time.Millisecond, nil
	}
	base := vmi.DeepCopy() // the VMI as this pass leaves it
	base.Status = *st
	hot := v.hotplugVolumes(vmi)
	var hotplugErr error
	if needsHandleHotplug(hotNames(hot), pods) {
		var created *corev1.Pod
		created, hotplugErr = v.handleHotplugVolumes(ctx, base, hot, pods)
		if created != nil {
			pods = append([]*corev1.Pod{created}, pods...)
		}
	}
	v.noteSyncErr(key, hotplugErr)
	// The status update runs whether or not the pod handling failed (v1.7.0
	// vmi.go:335-337).
	st.VolumeStatus = controllerVolumeStatus(controllerInput{feat: v.c.feat, vmi: base, hot: hot, pods: pods})
	v.setActivePods(vmi, st)
	hook := v.afterWrite.Load() // before the write: its watch event may beat us back
	if err := writeVMIStatus(ctx, v.c, vmi, st); err != nil {
		return 0, err
	}
	if hook != nil {
		(*hook)(key, st.VolumeStatus)
	}
	if hotplugErr != nil {
		return 0, hotplugErr // requeued with backoff
	}
	return 0, nil
}

// setActivePods writes, on host nodes, every pod the VMI controls (its
// virt-launcher pods: a live migration's source and target, and those that
// ended, which stay) with its node, as virt-controller does on each pass
// (v1.7.0 pkg/virt-controller/watch/vmi/lifecycle.go:909-928, v1.5.3
// vmi.go:1562-1585). Without host nodes there are no launcher pods.
func (v *vmiController) setActivePods(vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceStatus) {
	if !v.c.opts.Kubelets {
		return
	}
	pods := v.c.launcherPods(vmi)
	if len(pods) == 0 && st.ActivePods == nil {
		return
	}
	st.ActivePods = map[types.UID]string{}
	for _, p := range pods {
		if metav1.IsControlledBy(p, vmi) {
			st.ActivePods[p.UID] = p.Spec.NodeName
		}
	}
}

// hotplugVolumes are the VMI's hotplug volumes with their claims from the
// cache (nil when missing).
func (v *vmiController) hotplugVolumes(vmi *kubevirtv1.VirtualMachineInstance) []hotVolume {
	var out []hotVolume
	for _, vol := range vmi.Spec.Volumes {
		if isHotpluggable(vol) {
			claim := volumeClaim(vol)
			out = append(out, hotVolume{name: vol.Name, claim: claim, pvc: v.c.pvc(vmi.Namespace, claim)})
		}
	}
	return out
}

// handleHotplugVolumes is v1.7.0 volume-hotplug.go:132 (v1.5.3 vmi.go:1730):
// every hotplug volume whose claim exists is "ready", bound or not
// (pkg/storage/types/pvc.go:223 VolumeReadyToAttachToNode asks CDI only
// about claims a DataVolume owns), so an unbound claim goes into the pod
// and keeps it Pending; a missing claim aborts the pass for the whole VMI
// before any pod is created or deleted. It returns the pod it created.
func (v *vmiController) handleHotplugVolumes(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, hot []hotVolume, pods []*corev1.Pod) (*corev1.Pod, error) {
	for _, h := range hot {
		if h.pvc == nil {
			// The exact text of volume-hotplug.go:141 around PvcNotFoundError.
			return nil, fmt.Errorf("Error determining volume status %v", fmt.Sprintf("didn't find PVC %v", h.claim))
		}
	}
	log := v.c.log.WithValues("vm", vmi.Namespace+"/"+vmi.Name)
	names := hotNames(hot)
	current, old := activeAndOldPods(v.c.feat, names, pods)
	var created *corev1.Pod
	if current == nil && !hasPendingPods(old) && len(names) > 0 {
		p, err := v.createAttachmentPod(ctx, vmi, hot)
		if err != nil {
			return nil, fmt.Errorf("Error creating attachment pod %v", err)
		}
		log.V(2).Info("attachment pod created", "pod", p.Name, "volumes", names)
		created, current = p, p
	}
	for _, p := range oldPodsToDelete(v.c.feat, vmi, current, old, len(names)) {
		log.V(2).Info("deleting old attachment pod", "pod", p.Name, "phase", p.Status.Phase)
		if err := v.deletePod(ctx, p); err != nil {
			return created, fmt.Errorf("Error deleting attachment pod %v", err)
		}
	}
	return created, nil
}

// schedule is what virt-controller adds to the status once the
// virt-launcher pod runs: phase Scheduled, the node, the interfaces and the
// boot volumes' entries. The same pass handles the hotplug volumes, so
// their entries exist before virt-handler looks (v1.7.0 lifecycle.go:360-380).
// node is the launcher pod's node with Options.Kubelets, else "".
func (v *vmiController) schedule(vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceStatus, node string) {
	st.Phase = kubevirtv1.Scheduled
	if st.NodeName == "" {
		st.NodeName = v.c.opts.NodeName
		if n := vmi.Annotations[annotationNodeName]; n != "" {
			st.NodeName = n
		}
		if node != "" {
			st.NodeName = node
		}
	}
	if len(st.Interfaces) == 0 {
		names := []string{"default"}
		if ifaces := vmi.Spec.Domain.Devices.Interfaces; len(ifaces) > 0 {
			names = nil
			for _, i := range ifaces {
				names = append(names, i.Name)
			}
		}
		for i, n := range names {
			st.Interfaces = append(st.Interfaces, kubevirtv1.VirtualMachineInstanceNetworkInterface{
				Name: n, MAC: v.randomMAC(), IP: fmt.Sprintf("10.52.0.%d", 10+v.c.jit.intn(200)), InterfaceName: fmt.Sprintf("eth%d", i),
			})
		}
	}
	used := map[string]bool{}
	for _, e := range st.VolumeStatus {
		used[e.Target] = true
	}
	for _, vol := range vmi.Spec.Volumes {
		if isHotpluggable(vol) || slices.ContainsFunc(st.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == vol.Name }) {
			continue
		}
		d, _ := diskNamed(vmi.Spec.Domain.Devices.Disks, vol.Name)
		e := kubevirtv1.VolumeStatus{Name: vol.Name, Target: nextTarget(&d, used)}
		if c := volumeClaim(vol); c != "" {
			e.PersistentVolumeClaimInfo = &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: c}
		}
		st.VolumeStatus = append(st.VolumeStatus, e)
	}
	sortEntries(st.VolumeStatus)
}

func (v *vmiController) randomMAC() string {
	b := make([]string, 5)
	for i := range b {
		b[i] = fmt.Sprintf("%02x", v.c.jit.intn(256))
	}
	return "02:" + strings.Join(b, ":")
}

func (v *vmiController) createAttachmentPod(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, hot []hotVolume) (*corev1.Pod, error) {
	node := vmi.Status.NodeName
	if node == "" {
		node = v.c.opts.NodeName
	}
	pod := attachmentPod(vmi, hot, node, 30)
	if v.c.opts.Kubelets {
		l := v.c.launcherRunning(vmi)
		if l == nil {
			return nil, fmt.Errorf("virt-launcher pod of VMI %s/%s is not running", vmi.Namespace, vmi.Name)
		}
		kubeletAttachmentPod(pod, vmi, hot, l)
	}
	created, err := v.c.kube.CoreV1().Pods(vmi.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	v.mu.Lock()
	if v.expect[vmi.UID] == nil {
		v.expect[vmi.UID] = map[string]time.Time{}
	}
	v.expect[vmi.UID][created.Name] = time.Now()
	v.mu.Unlock()
	return created, nil
}

// expectationsMet reports whether every pod this controller created for
// the VMI is in the cache (or was given up on after 10 s).
func (v *vmiController) expectationsMet(uid types.UID, pods []*corev1.Pod) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	met := true
	for name, at := range v.expect[uid] {
		if time.Since(at) > 10*time.Second || slices.ContainsFunc(pods, func(p *corev1.Pod) bool { return p.Name == name }) {
			delete(v.expect[uid], name)
			continue
		}
		met = false
	}
	return met
}

func (v *vmiController) deletePod(ctx context.Context, p *corev1.Pod) error {
	return deleteAttachmentPod(ctx, v.c, p)
}

// deleteAttachmentPod deletes an attachment pod at once (grace period 0,
// v1.7.0 volume-hotplug.go:352); kubelet still takes Timings.PodDelete.
func deleteAttachmentPod(ctx context.Context, c *cluster, p *corev1.Pod) error {
	err := c.kube.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: ptr.To(p.UID)},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return err
	}
	return nil
}

// deleteOrphans removes the attachment pods of a VMI that is gone: no
// garbage collector runs here.
func (v *vmiController) deleteOrphans(ctx context.Context, key string) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	pods, _ := v.c.podLister.Pods(ns).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: name}))
	for _, p := range pods {
		if p.DeletionTimestamp == nil {
			if err := v.deletePod(ctx, p); err != nil {
				v.c.log.V(1).Info("deleting orphaned attachment pod failed", "pod", p.Namespace+"/"+p.Name, "err", err)
			}
		}
	}
}

func (v *vmiController) noteSyncErr(key string, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err == nil {
		delete(v.syncErr, key)
		return
	}
	if v.syncErr[key] != err.Error() {
		v.c.log.Info("hotplug handling failed", "vm", key, "err", err)
	}
	v.syncErr[key] = err.Error()
}

// lastSyncErr is the hotplug error of the VMI's last pass ("" if none).
func (v *vmiController) lastSyncErr(key string) string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.syncErr[key]
}

func (v *vmiController) pause(key string, on bool) {
	v.mu.Lock()
	v.paused[key] = on
	v.mu.Unlock()
	if !on {
		v.queue.Add(key)
	}
}

func (v *vmiController) isPaused(key string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.paused[key]
}

// writeVolumeStatus writes entries and phase if they differ from the cache.
func writeVolumeStatus(ctx context.Context, c *cluster, vmi *kubevirtv1.VirtualMachineInstance, entries []kubevirtv1.VolumeStatus, phase kubevirtv1.VirtualMachineInstancePhase) error {
	st := vmi.Status.DeepCopy()
	st.VolumeStatus, st.Phase = entries, phase
	return writeVMIStatus(ctx, c, vmi, st)
}

// writeVMIStatus updates the VMI's status with the cached resourceVersion
// as precondition: a writer that raced another one retries on a fresh
// cache, as KubeVirt's test-guarded status patches do.
func writeVMIStatus(ctx context.Context, c *cluster, vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceStatus) error {
	if equality.Semantic.DeepEqual(st, &vmi.Status) {
		return nil
	}
	upd := vmi.DeepCopy()
	upd.Status = *st
	err := c.kv.update(ctx, resVMIs, vmi.Namespace, vmi.Name, "status", upd, &kubevirtv1.VirtualMachineInstance{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// sweepOtherNodes deletes the VMI's attachment pods left on a node it no
// longer runs on once no migration is under way: KubeVirt's belong to the
// source virt-launcher pod and go with it, whichever pass created them (one
// that read the VMI just before the hand-off may have made one there).
func (v *vmiController) sweepOtherNodes(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	if v.c.opts.Kubelets {
		return v.deleteOrphanedAttachmentPods(ctx, vmi)
	}
	if vmi.Status.NodeName == "" || activeMigration(vmi) != "" {
		return nil
	}
	all, _ := v.c.podLister.Pods(vmi.Namespace).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: vmi.Name}))
	for _, p := range all {
		if p.Spec.NodeName == "" || p.Spec.NodeName == vmi.Status.NodeName || p.DeletionTimestamp != nil || !metav1.IsControlledBy(p, vmi) {
			continue
		}
		if job := p.Annotations[kubevirtv1.MigrationJobNameAnnotation]; job != "" {
			if m, ok := v.c.migration(vmi.Namespace, job); ok && !m.IsFinal() {
				continue // a migration's target pod before its hand-off
			}
		}
		if err := deleteAttachmentPod(ctx, v.c, p); err != nil {
			return err
		}
	}
	return nil
}

// deleteOrphanedAttachmentPods deletes, with Options.Kubelets, the VMI's
// attachment pods whose virt-launcher pod is down or gone (v1.7.0
// volume-hotplug.go:311-341 for a launcher that ended; for one that is
// gone the host's garbage collector would, and none runs here). A pass that
// read the VMI just before a migration's end may have created one for the
// source launcher after it was deleted.
func (v *vmiController) deleteOrphanedAttachmentPods(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	up := map[types.UID]bool{}
	for _, l := range v.c.launcherPods(vmi) {
		if l.DeletionTimestamp == nil && l.Status.Phase != corev1.PodSucceeded && l.Status.Phase != corev1.PodFailed {
			up[l.UID] = true
		}
	}
	all, _ := v.c.podLister.Pods(vmi.Namespace).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: vmi.Name}))
	for _, p := range all {
		ref := metav1.GetControllerOf(p)
		if p.Labels[labelAttachmentPod] != valueAttachmentPod || p.DeletionTimestamp != nil || ref == nil || ref.Kind != "Pod" || up[ref.UID] {
			continue
		}
		v.c.log.V(2).Info("deleting orphaned attachment pod", "vm", vmi.Namespace+"/"+vmi.Name, "pod", p.Name, "launcher", ref.Name)
		if err := deleteAttachmentPod(ctx, v.c, p); err != nil {
			return err
		}
	}
	return nil
}

// attachmentPod is an attachment pod of the VMI on node holding the hotplug
// volumes hot, owned by the VMI (KubeVirt's belongs to the virt-launcher pod,
// which the simulator has only with Options.Kubelets).
func attachmentPod(vmi *kubevirtv1.VirtualMachineInstance, hot []hotVolume, node string, grace int64) *corev1.Pod {
	names, _ := json.Marshal(hotNames(hot))
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: "hp-volume-",
			Namespace:    vmi.Namespace,
			Labels:       map[string]string{labelAttachmentPod: valueAttachmentPod, labelAttachmentPodVMI: vmi.Name},
			Annotations:  map[string]string{annotationAttachmentPodVolumes: string(names)},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachineInstance", Name: vmi.Name, UID: vmi.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			TerminationGracePeriodSeconds: ptr.To(grace),
			Containers: []corev1.Container{{
				Name: "hotplug-disk", Image: "kubevirt/virt-launcher:simulated",
				Command: []string{"/bin/sh", "-c", "sleep infinity"},
			}},
		},
	}
	for i, h := range hot {
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{
			Name:         fmt.Sprintf("hotplug-disk-%d", i),
			VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: h.claim}},
		})
	}
	return pod
}
