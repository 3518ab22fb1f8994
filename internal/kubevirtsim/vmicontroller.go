package kubevirtsim

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
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

// Attachment pod labels and annotations.
const (
	labelAttachmentPod = "kubevirt.io"
	valueAttachmentPod = "hotplug-disk"
	// LabelAttachmentPodVMI names the VMI an attachment pod belongs to.
	LabelAttachmentPodVMI = "kubevirtsim.io/vmi"
	// AnnotationAttachmentPodVolumes lists (JSON) the VMI volume names an
	// attachment pod holds.
	AnnotationAttachmentPodVolumes = "kubevirtsim.io/volumes"
)

// volumeStatus reasons and messages (reference §3).
const (
	reasonPVCNotReady      = "PVCNotReady"
	reasonPVCNotFound      = "FailedPvcNotFound"
	reasonSuccessfulCreate = "SuccessfulCreate"
	reasonSuccessfulDelete = "SuccessfulDelete"
	reasonMounted          = "VolumeMountedToPod"
	reasonUnMounted        = "VolumeUnMountedFromPod"
	reasonVolumeReady      = "VolumeReady"
)

// vmiMem is what virt-controller and virt-handler keep in memory per VMI:
// the deadlines of the simulated work in flight.
type vmiMem struct {
	mountAt    map[string]time.Time // AttachedToNode -> MountedToPod
	readyAt    map[string]time.Time // MountedToPod -> Ready
	unplugAt   map[string]time.Time // removal: Ready -> UnMountedFromPod
	plugged    map[string]bool      // DiskHook.Plug succeeded
	expect     map[string]time.Time // created pods not yet in the cache
	shutdownAt time.Time
}

func (s *Sim) vmiMemFor(uid types.UID) *vmiMem {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.vmis[uid]
	if m == nil {
		m = &vmiMem{
			mountAt: map[string]time.Time{}, readyAt: map[string]time.Time{}, unplugAt: map[string]time.Time{},
			plugged: map[string]bool{}, expect: map[string]time.Time{},
		}
		s.vmis[uid] = m
	}
	return m
}

func (s *Sim) forgetVMI(uid types.UID) {
	s.mu.Lock()
	delete(s.vmis, uid)
	s.mu.Unlock()
}

func podVMIKey(obj any) string {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Labels[LabelAttachmentPodVMI] == "" {
		return ""
	}
	return p.Namespace + "/" + p.Labels[LabelAttachmentPodVMI]
}

func podVolumes(p *corev1.Pod) []string {
	var names []string
	_ = json.Unmarshal([]byte(p.Annotations[AnnotationAttachmentPodVolumes]), &names)
	return names
}

func podHas(p *corev1.Pod, volume string) bool { return slices.Contains(podVolumes(p), volume) }

func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
		return false
	}
	return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].Ready
}

func (s *Sim) attachmentPods(vmi *kubevirtv1.VirtualMachineInstance) []*corev1.Pod {
	sel := labels.SelectorFromSet(labels.Set{LabelAttachmentPodVMI: vmi.Name})
	all, _ := s.podLister.Pods(vmi.Namespace).List(sel)
	var out []*corev1.Pod
	for _, p := range all {
		for _, o := range p.OwnerReferences {
			if o.UID == vmi.UID {
				out = append(out, p)
				break
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreationTimestamp.Equal(&out[j].CreationTimestamp) {
			return out[i].CreationTimestamp.After(out[j].CreationTimestamp.Time)
		}
		return out[i].Name > out[j].Name
	})
	return out
}

type hotVol struct {
	vol   kubevirtv1.Volume
	claim string
	pvc   *corev1.PersistentVolumeClaim
}

func (s *Sim) hotplugVolumes(vmi *kubevirtv1.VirtualMachineInstance) []hotVol {
	var out []hotVol
	for _, v := range vmi.Spec.Volumes {
		if !isHotpluggable(v) {
			continue
		}
		h := hotVol{vol: v, claim: volumeClaim(v)}
		if pvc, err := s.pvcLister.PersistentVolumeClaims(vmi.Namespace).Get(h.claim); err == nil {
			h.pvc = pvc
		}
		out = append(out, h)
	}
	return out
}

// syncVMI runs virt-controller's VMI controller and virt-handler for one
// VMI: lifecycle phases, the attachment pod and the volumeStatus machine.
func (s *Sim) syncVMI(ctx context.Context, key string) (time.Duration, error) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	vmi, ok := s.cachedVMI(key)
	if !ok {
		// Without a garbage collector, orphaned attachment pods are ours to remove.
		pods, _ := s.podLister.Pods(ns).List(labels.SelectorFromSet(labels.Set{LabelAttachmentPodVMI: name}))
		for _, p := range pods {
			if p.DeletionTimestamp == nil {
				s.deletePod(ctx, p)
			}
		}
		return 0, nil
	}
	mem := s.vmiMemFor(vmi.UID)
	if vmi.DeletionTimestamp != nil {
		return s.shutdownVMI(ctx, vmi, mem)
	}
	log := s.log.WithValues("vm", key)
	now := time.Now()
	st := vmi.Status.DeepCopy()

	if s.faults.isNotRunning(key) {
		if st.Phase == kubevirtv1.Running || st.Phase == "" {
			st.Phase = kubevirtv1.Scheduled
			return 0, s.writeVMIStatus(ctx, vmi, st)
		}
		return 0, nil
	}
	switch st.Phase {
	case "", kubevirtv1.Pending, kubevirtv1.Scheduling:
		s.initVMIStatus(vmi, st)
	case kubevirtv1.Scheduled, kubevirtv1.Running:
	default:
		return 0, nil // Succeeded, Failed, Unknown: nothing to do
	}

	pods := s.attachmentPods(vmi)
	hot := s.hotplugVolumes(vmi)
	wake := time.Duration(0)
	soon := func(d time.Duration) {
		if d < time.Millisecond {
			d = time.Millisecond
		}
		if wake == 0 || d < wake {
			wake = d
		}
	}

	// virt-controller: the single attachment pod.
	var ready []string
	for _, h := range hot {
		if h.pvc != nil && h.pvc.Status.Phase == corev1.ClaimBound {
			ready = append(ready, h.vol.Name)
		}
	}
	var current *corev1.Pod
	var old []*corev1.Pod
	for _, p := range pods {
		if current == nil && p.DeletionTimestamp == nil && sameSet(podVolumes(p), ready) {
			current = p
		} else {
			old = append(old, p)
		}
	}
	waiting := s.pendingExpectations(mem, pods, now)
	if waiting {
		soon(10 * time.Millisecond)
	} else {
		oldPending := false
		for _, p := range old {
			if p.Status.Phase == corev1.PodRunning {
				continue
			}
			oldPending = true
			if p.DeletionTimestamp == nil {
				log.V(2).Info("hotplug set changed while the attachment pod is pending: deleting it", "pod", p.Name)
				s.deletePod(ctx, p)
			}
		}
		if current == nil && len(ready) > 0 && !oldPending {
			if podName, err := s.createAttachmentPod(ctx, vmi, st.NodeName, hot, ready); err != nil {
				if ctx.Err() != nil {
					return 0, nil
				}
				log.Error(err, "creating attachment pod")
				soon(s.t.HandlerPoll)
			} else {
				mem.expect[podName] = now
				log.V(2).Info("attachment pod created", "pod", podName, "volumes", ready)
			}
		}
		inSpec := map[string]bool{}
		for _, h := range hot {
			inSpec[h.vol.Name] = true
		}
		for _, p := range old {
			if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
				continue
			}
			if s.opts.Profile != ProfileV15 {
				if len(ready) > 0 && (current == nil || !podReady(current)) {
					continue // keep the old pod until the new one runs
				}
				if stillMounted(p, st.VolumeStatus, inSpec) {
					continue // wait for the unplug of removed volumes
				}
			}
			log.V(2).Info("deleting old attachment pod", "pod", p.Name)
			s.deletePod(ctx, p)
		}
	}

	// virt-controller + virt-handler: volumeStatus.
	d, err := s.computeVolumeStatus(ctx, vmi, st, mem, hot, pods, current, now)
	if err != nil {
		return 0, err
	}
	if d > 0 {
		soon(d)
	}
	if st.Phase == kubevirtv1.Scheduled && allMounted(hot, st.VolumeStatus) {
		st.Phase = kubevirtv1.Running
		log.V(2).Info("VMI running")
	}
	if err := s.writeVMIStatus(ctx, vmi, st); err != nil {
		return 0, err
	}
	return wake, nil
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	x, y := slices.Clone(a), slices.Clone(b)
	slices.Sort(x)
	slices.Sort(y)
	return slices.Equal(x, y)
}

// stillMounted reports whether p holds a removed volume not yet unmounted.
func stillMounted(p *corev1.Pod, entries []kubevirtv1.VolumeStatus, inSpec map[string]bool) bool {
	for _, name := range podVolumes(p) {
		if inSpec[name] {
			continue
		}
		for _, e := range entries {
			if e.Name == name && (e.Phase == kubevirtv1.VolumeReady || e.Phase == kubevirtv1.HotplugVolumeMounted) {
				return true
			}
		}
	}
	return false
}

func allMounted(hot []hotVol, entries []kubevirtv1.VolumeStatus) bool {
	for _, h := range hot {
		ok := false
		for _, e := range entries {
			if e.Name == h.vol.Name && (e.Phase == kubevirtv1.VolumeReady || e.Phase == kubevirtv1.HotplugVolumeMounted) {
				ok = true
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

// pendingExpectations reports whether a pod this controller created is not
// in the cache yet (deciding on a stale cache would create duplicates).
func (s *Sim) pendingExpectations(mem *vmiMem, pods []*corev1.Pod, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	waiting := false
	for name, at := range mem.expect {
		found := slices.ContainsFunc(pods, func(p *corev1.Pod) bool { return p.Name == name })
		if found || now.Sub(at) > 10*time.Second {
			delete(mem.expect, name)
			continue
		}
		waiting = true
	}
	return waiting
}

func (s *Sim) initVMIStatus(vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceStatus) {
	st.Phase = kubevirtv1.Scheduled
	if st.NodeName == "" {
		st.NodeName = s.opts.NodeName
		if n := vmi.Annotations[AnnotationNodeName]; n != "" {
			st.NodeName = n
		}
	}
	if len(st.Interfaces) == 0 {
		ifaces := vmi.Spec.Domain.Devices.Interfaces
		names := []string{"default"}
		if len(ifaces) > 0 {
			names = nil
			for _, i := range ifaces {
				names = append(names, i.Name)
			}
		}
		for i, n := range names {
			st.Interfaces = append(st.Interfaces, kubevirtv1.VirtualMachineInstanceNetworkInterface{
				Name: n, MAC: s.randomMAC(), IP: fmt.Sprintf("10.52.0.%d", 10+s.jit.intn(200)), InterfaceName: fmt.Sprintf("eth%d", i),
			})
		}
	}
	// Non-hotplug volumes are attached at boot.
	used := map[string]bool{}
	for _, e := range st.VolumeStatus {
		used[e.Target] = true
	}
	disks := map[string]kubevirtv1.Disk{}
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		disks[d.Name] = d
	}
	for _, v := range vmi.Spec.Volumes {
		if isHotpluggable(v) || slices.ContainsFunc(st.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == v.Name }) {
			continue
		}
		d := disks[v.Name]
		e := kubevirtv1.VolumeStatus{Name: v.Name, Target: nextTarget(&d, used)}
		if c := volumeClaim(v); c != "" {
			e.PersistentVolumeClaimInfo = &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: c}
		}
		st.VolumeStatus = append(st.VolumeStatus, e)
	}
	sortEntries(st.VolumeStatus)
}

func (s *Sim) randomMAC() string {
	b := make([]string, 5)
	for i := range b {
		b[i] = fmt.Sprintf("%02x", s.jit.intn(256))
	}
	return "02:" + strings.Join(b, ":")
}

// nextTarget picks the first free sdX (vdX for virtio) name.
func nextTarget(d *kubevirtv1.Disk, used map[string]bool) string {
	prefix := "sd"
	if d != nil && diskBus(d) == kubevirtv1.DiskBusVirtio {
		prefix = "vd"
	}
	for i := 0; ; i++ {
		t := prefix + driveLetters(i)
		if !used[t] {
			used[t] = true
			return t
		}
	}
}

func driveLetters(i int) string {
	s := ""
	for i++; i > 0; i = (i - 1) / 26 {
		s = string(rune('a'+(i-1)%26)) + s
	}
	return s
}

func sortEntries(e []kubevirtv1.VolumeStatus) {
	sort.SliceStable(e, func(i, j int) bool { return e[i].Name < e[j].Name })
}

func pvcPhase(claim string, pvc *corev1.PersistentVolumeClaim) (kubevirtv1.VolumePhase, string, string) {
	switch {
	case pvc == nil:
		return kubevirtv1.VolumePending, reasonPVCNotFound, fmt.Sprintf("PVC %s not found", claim)
	case pvc.Status.Phase == corev1.ClaimBound:
		return kubevirtv1.VolumeBound, reasonPVCNotReady, "PVC is in phase Bound"
	case pvc.Status.Phase == corev1.ClaimLost:
		return kubevirtv1.VolumePending, reasonPVCNotReady, "PVC is in phase ClaimLost"
	default:
		return kubevirtv1.VolumePending, reasonPVCNotReady, "PVC is in phase ClaimPending"
	}
}

func pvcInfo(claim string, pvc *corev1.PersistentVolumeClaim) *kubevirtv1.PersistentVolumeClaimInfo {
	info := &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: claim}
	if pvc != nil {
		info.AccessModes = pvc.Spec.AccessModes
		info.VolumeMode = pvc.Spec.VolumeMode
		info.Capacity = pvc.Status.Capacity
		info.Requests = pvc.Spec.Resources.Requests
	}
	return info
}

func setPVCPhase(e *kubevirtv1.VolumeStatus, claim string, pvc *corev1.PersistentVolumeClaim) {
	p, r, m := pvcPhase(claim, pvc)
	setPhase(e, p, r, m)
}

func setPhase(e *kubevirtv1.VolumeStatus, phase kubevirtv1.VolumePhase, reason, msg string) {
	e.Phase, e.Reason, e.Message = phase, reason, msg
}

// computeVolumeStatus advances every hotplug entry of st by one step where
// its time has come (reference §3, §7 items 14-16). It returns the delay until
// the next deadline.
func (s *Sim) computeVolumeStatus(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceStatus,
	mem *vmiMem, hot []hotVol, pods []*corev1.Pod, current *corev1.Pod, now time.Time) (time.Duration, error) {
	vmKey := vmi.Namespace + "/" + vmi.Name
	log := s.log.WithValues("vm", vmKey)
	var wake time.Duration
	after := func(t time.Time) {
		d := t.Sub(now)
		if d < time.Millisecond {
			d = time.Millisecond
		}
		if wake == 0 || d < wake {
			wake = d
		}
	}
	deadline := func(m map[string]time.Time, name string, d time.Duration) time.Time {
		s.mu.Lock()
		defer s.mu.Unlock()
		t, ok := m[name]
		if !ok {
			t = now.Add(s.jit.d(d))
			m[name] = t
		}
		return t
	}
	forget := func(name string, ms ...map[string]time.Time) {
		s.mu.Lock()
		for _, m := range ms {
			delete(m, name)
		}
		s.mu.Unlock()
	}
	// findPod prefers the current pod, then any live pod, then a deleting one.
	findPod := func(volume string) *corev1.Pod {
		if current != nil && podHas(current, volume) {
			return current
		}
		var deleting *corev1.Pod
		for _, p := range pods {
			if !podHas(p, volume) {
				continue
			}
			if p.DeletionTimestamp == nil {
				return p
			}
			if deleting == nil {
				deleting = p
			}
		}
		return deleting
	}
	podByName := func(name string) *corev1.Pod {
		for _, p := range pods {
			if p.Name == name {
				return p
			}
		}
		return nil
	}

	oldEntries := map[string]kubevirtv1.VolumeStatus{}
	used := map[string]bool{}
	for _, e := range st.VolumeStatus {
		oldEntries[e.Name] = e
		if e.Target != "" {
			used[e.Target] = true
		}
	}
	disks := map[string]kubevirtv1.Disk{}
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		disks[d.Name] = d
	}
	inSpec := map[string]bool{}
	var out []kubevirtv1.VolumeStatus
	for _, e := range st.VolumeStatus {
		if e.HotplugVolume == nil && slices.ContainsFunc(vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == e.Name }) {
			out = append(out, e) // permanent volume
		}
	}

	fresh := func(h hotVol) kubevirtv1.VolumeStatus {
		e := kubevirtv1.VolumeStatus{Name: h.vol.Name, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{}}
		setPVCPhase(&e, h.claim, h.pvc)
		e.PersistentVolumeClaimInfo = pvcInfo(h.claim, h.pvc)
		return e
	}

	for _, h := range hot {
		name := h.vol.Name
		inSpec[name] = true
		e, ok := oldEntries[name]
		if !ok || e.HotplugVolume == nil {
			e = fresh(h)
		} else {
			e = *e.DeepCopy()
		}
		vlog := log.WithValues("volume", name)

		// A re-added volume whose previous unplug has not finished.
		if e.Phase == kubevirtv1.HotplugVolumeDetaching || e.Phase == kubevirtv1.HotplugVolumeUnMounted {
			if s.opts.Profile == ProfileV15 && s.opts.StuckDetachOnReadd && e.Phase == kubevirtv1.HotplugVolumeDetaching {
				out = append(out, e) // the 1.5 bug: stuck for good
				continue
			}
			p := podByName(e.HotplugVolume.AttachPodName)
			switch {
			case p == nil:
				e = fresh(h)
			case p.DeletionTimestamp == nil && e.Phase == kubevirtv1.HotplugVolumeUnMounted:
				// Re-added before its pod went away: mount it again.
				setPhase(&e, kubevirtv1.HotplugVolumeAttachedToNode, reasonSuccessfulCreate, fmt.Sprintf("Created hotplug attachment pod %s, for volume %s", p.Name, name))
			default:
				if p.DeletionTimestamp != nil && e.Phase == kubevirtv1.HotplugVolumeUnMounted {
					setPhase(&e, kubevirtv1.HotplugVolumeDetaching, reasonSuccessfulDelete, fmt.Sprintf("Deleted hotplug attachment pod %s, for volume %s", p.Name, name))
				}
				out = append(out, e)
				continue
			}
		}

		pod := findPod(name)
		switch e.Phase {
		case "", kubevirtv1.VolumePending, kubevirtv1.VolumeBound, kubevirtv1.HotplugVolumeAttachedToNode:
			if pod == nil || pod.DeletionTimestamp != nil || h.pvc == nil || h.pvc.Status.Phase != corev1.ClaimBound {
				e.HotplugVolume.AttachPodUID = ""
				setPVCPhase(&e, h.claim, h.pvc)
				e.PersistentVolumeClaimInfo = pvcInfo(h.claim, h.pvc)
				forget(name, mem.mountAt)
				break
			}
			e.HotplugVolume.AttachPodName = pod.Name
			e.HotplugVolume.AttachPodUID = ""
			if podReady(pod) {
				e.HotplugVolume.AttachPodUID = pod.UID
			}
			if e.Phase != kubevirtv1.HotplugVolumeAttachedToNode {
				setPhase(&e, kubevirtv1.HotplugVolumeAttachedToNode, reasonSuccessfulCreate, fmt.Sprintf("Created hotplug attachment pod %s, for volume %s", pod.Name, name))
				e.PersistentVolumeClaimInfo = pvcInfo(h.claim, h.pvc)
				vlog.V(2).Info("volume attached to node", "pod", pod.Name)
				break // virt-handler sees it on a later pass
			}
			if !podReady(pod) {
				forget(name, mem.mountAt)
				break
			}
			at := deadline(mem.mountAt, name, s.t.Mount)
			if now.Before(at) {
				after(at)
				break
			}
			forget(name, mem.mountAt)
			setPhase(&e, kubevirtv1.HotplugVolumeMounted, reasonMounted, fmt.Sprintf("Volume %s has been mounted in virt-launcher pod", name))
			vlog.V(2).Info("volume mounted to pod")
			after(deadline(mem.readyAt, name, s.t.DomainAttach))
		case kubevirtv1.HotplugVolumeMounted:
			s.switchPod(&e, pod)
			at := deadline(mem.readyAt, name, s.t.DomainAttach)
			if now.Before(at) {
				after(at)
				break
			}
			if !s.isPlugged(mem, name) {
				if err := s.plug(ctx, vmKey, name, h.claim); err != nil {
					vlog.Info("disk hook Plug failed, retrying", "err", err)
					after(now.Add(s.t.HandlerPoll))
					break
				}
				s.setPlugged(mem, name, true)
			}
			forget(name, mem.readyAt)
			d := disks[name]
			e.Target = nextTarget(&d, used)
			setPhase(&e, kubevirtv1.VolumeReady, reasonVolumeReady, fmt.Sprintf("Successfully attach hotplugged volume %s to VM", name))
			vlog.V(1).Info("volume ready", "target", e.Target)
		case kubevirtv1.VolumeReady:
			s.switchPod(&e, pod)
		}
		out = append(out, e)
	}

	// Entries whose volume left the spec.
	for _, e := range st.VolumeStatus {
		if inSpec[e.Name] || e.HotplugVolume == nil {
			continue
		}
		e = *e.DeepCopy()
		name := e.Name
		vlog := log.WithValues("volume", name)
		pod := podByName(e.HotplugVolume.AttachPodName)
		if pod == nil {
			pod = findPod(name)
		}
		podName := e.HotplugVolume.AttachPodName
		if pod != nil {
			podName = pod.Name
		}
		if s.opts.Profile == ProfileV15 {
			if e.Phase != kubevirtv1.HotplugVolumeDetaching {
				if s.isPlugged(mem, name) {
					if err := s.unplug(ctx, vmKey, name); err != nil {
						vlog.Info("disk hook Unplug failed, retrying", "err", err)
						after(now.Add(s.t.HandlerPoll))
						out = append(out, e)
						continue
					}
					s.setPlugged(mem, name, false)
				}
				e.Target = ""
				setPhase(&e, kubevirtv1.HotplugVolumeDetaching, reasonSuccessfulDelete, fmt.Sprintf("Deleted hotplug attachment pod %s, for volume %s", podName, name))
				vlog.V(2).Info("volume detaching")
			}
			if pod == nil {
				forget(name, mem.mountAt, mem.readyAt, mem.unplugAt)
				vlog.V(1).Info("volume entry removed")
				continue
			}
			out = append(out, e)
			continue
		}
		switch e.Phase {
		case kubevirtv1.VolumeReady, kubevirtv1.HotplugVolumeMounted:
			at := deadline(mem.unplugAt, name, s.t.Detach)
			if now.Before(at) {
				after(at)
				break
			}
			if s.isPlugged(mem, name) {
				if err := s.unplug(ctx, vmKey, name); err != nil {
					vlog.Info("disk hook Unplug failed, retrying", "err", err)
					after(now.Add(s.t.HandlerPoll))
					break
				}
				s.setPlugged(mem, name, false)
			}
			forget(name, mem.unplugAt, mem.readyAt)
			e.Target = ""
			setPhase(&e, kubevirtv1.HotplugVolumeUnMounted, reasonUnMounted, fmt.Sprintf("Volume %s has been unmounted from virt-launcher pod", name))
			vlog.V(2).Info("volume unmounted from pod")
		default:
			if pod == nil {
				forget(name, mem.mountAt, mem.readyAt, mem.unplugAt)
				vlog.V(1).Info("volume entry removed")
				continue
			}
			if pod.DeletionTimestamp != nil && e.Phase != kubevirtv1.HotplugVolumeDetaching {
				setPhase(&e, kubevirtv1.HotplugVolumeDetaching, reasonSuccessfulDelete, fmt.Sprintf("Deleted hotplug attachment pod %s, for volume %s", pod.Name, name))
				vlog.V(2).Info("volume detaching")
			}
		}
		out = append(out, e)
	}
	sortEntries(out)
	st.VolumeStatus = out
	return wake, nil
}

// switchPod points a mounted entry at the current attachment pod once that
// pod is ready ("Ready entries stay Ready and switch attachPodName").
func (s *Sim) switchPod(e *kubevirtv1.VolumeStatus, pod *corev1.Pod) {
	if pod != nil && podReady(pod) && e.HotplugVolume.AttachPodName != pod.Name {
		e.HotplugVolume.AttachPodName = pod.Name
		e.HotplugVolume.AttachPodUID = pod.UID
	}
}

func (s *Sim) isPlugged(mem *vmiMem, name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return mem.plugged[name]
}

func (s *Sim) setPlugged(mem *vmiMem, name string, v bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v {
		mem.plugged[name] = true
	} else {
		delete(mem.plugged, name)
	}
}

func (s *Sim) plug(ctx context.Context, vm, volume, claim string) error {
	if s.opts.DiskHook == nil {
		return nil
	}
	return s.opts.DiskHook.Plug(ctx, vm, volume, claim)
}

func (s *Sim) unplug(ctx context.Context, vm, volume string) error {
	if s.opts.DiskHook == nil {
		return nil
	}
	return s.opts.DiskHook.Unplug(ctx, vm, volume)
}

func (s *Sim) writeVMIStatus(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceStatus) error {
	if equality.Semantic.DeepEqual(st, &vmi.Status) {
		return nil
	}
	upd := vmi.DeepCopy()
	upd.Status = *st
	if err := s.kv.update(ctx, resVMIs, vmi.Namespace, vmi.Name, "status", upd, &kubevirtv1.VirtualMachineInstance{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	return nil
}

func (s *Sim) createAttachmentPod(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string, hot []hotVol, names []string) (string, error) {
	ann, _ := json.Marshal(names)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: "hp-volume-",
			Namespace:    vmi.Namespace,
			Labels:       map[string]string{labelAttachmentPod: valueAttachmentPod, LabelAttachmentPodVMI: vmi.Name},
			Annotations:  map[string]string{AnnotationAttachmentPodVolumes: string(ann)},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachineInstance", Name: vmi.Name, UID: vmi.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			TerminationGracePeriodSeconds: ptr.To[int64](30),
			Containers: []corev1.Container{{
				Name: "hotplug-disk", Image: "kubevirt/virt-launcher:simulated",
				Command: []string{"/bin/sh", "-c", "sleep infinity"},
			}},
		},
	}
	if pod.Spec.NodeName == "" {
		pod.Spec.NodeName = s.opts.NodeName
	}
	for i, n := range names {
		for _, h := range hot {
			if h.vol.Name == n {
				pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{
					Name:         fmt.Sprintf("hotplug-disk-%d", i),
					VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: h.claim}},
				})
			}
		}
	}
	created, err := s.kube.CoreV1().Pods(vmi.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return created.Name, nil
}

func (s *Sim) deletePod(ctx context.Context, p *corev1.Pod) {
	err := s.kube.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(p.UID)}})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		s.log.V(1).Info("deleting attachment pod failed", "pod", p.Namespace+"/"+p.Name, "err", err)
	}
}

// shutdownVMI lets a deleted VMI linger for VMIShutdown, then unplugs its
// disks, deletes its attachment pods and drops its finalizer.
func (s *Sim) shutdownVMI(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, mem *vmiMem) (time.Duration, error) {
	now := time.Now()
	s.mu.Lock()
	if mem.shutdownAt.IsZero() {
		mem.shutdownAt = now.Add(s.jit.d(s.t.VMIShutdown))
	}
	at := mem.shutdownAt
	s.mu.Unlock()
	if now.Before(at) {
		return at.Sub(now), nil
	}
	vmKey := vmi.Namespace + "/" + vmi.Name
	for _, e := range vmi.Status.VolumeStatus {
		if e.HotplugVolume != nil && s.isPlugged(mem, e.Name) {
			if err := s.unplug(ctx, vmKey, e.Name); err != nil {
				s.log.Info("disk hook Unplug failed at shutdown, retrying", "vm", vmKey, "volume", e.Name, "err", err)
				return s.t.HandlerPoll, nil
			}
			s.setPlugged(mem, e.Name, false)
		}
	}
	for _, p := range s.attachmentPods(vmi) {
		if p.DeletionTimestamp == nil {
			s.deletePod(ctx, p)
		}
	}
	if !slices.Contains(vmi.Finalizers, vmiFinalizer) {
		return 0, nil
	}
	var keep []string
	for _, f := range vmi.Finalizers {
		if f != vmiFinalizer {
			keep = append(keep, f)
		}
	}
	patch, err := casPatch(casOp{"/metadata/finalizers", vmi.Finalizers, keep, true})
	if err != nil {
		return 0, err
	}
	if err := s.kv.patch(ctx, resVMIs, vmi.Namespace, vmi.Name, "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachineInstance{}); err != nil && !apierrors.IsNotFound(err) {
		return 0, err
	}
	s.log.V(2).Info("VMI shut down", "vm", vmKey)
	return 0, nil
}
