package kubevirtsim

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestInstall(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative, ServerVersion: "v1.8.0-sim"})
	ctx := testCtx(t, 30*time.Second)
	for _, c := range crds() {
		if _, err := s.c.ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, c.Name, metav1.GetOptions{}); err != nil {
			t.Errorf("CRD %s: %v", c.Name, err)
		}
	}
	kv := &kubevirtv1.KubeVirt{}
	if err := proxyKV(t, s).get(ctx, resKubeVirts, ns, "kubevirt", kv); err != nil {
		t.Fatal(err)
	}
	if fg := kv.Spec.Configuration.DeveloperConfiguration.FeatureGates; !slices.Equal(fg, []string{GateDeclarativeHotplugVolumes}) {
		t.Errorf("feature gates %v", fg)
	}
	setting, err := s.c.dyn.Resource(settingsGVR).Get(ctx, serverVersionSetting, metav1.GetOptions{})
	if err != nil || setting.Object["value"] != "v1.8.0-sim" {
		t.Errorf("server-version setting: %v %v", err, setting)
	}
	if sc, err := s.c.kube.StorageV1().StorageClasses().Get(ctx, "longhorn", metav1.GetOptions{}); err != nil || sc.Provisioner != LonghornProvisioner {
		t.Errorf("storage class: %v", err)
	}

	// kubevirt.io/api objects round-trip through the CRD schema.
	in := &kubevirtv1.VirtualMachine{
		TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachine"},
		ObjectMeta: metav1.ObjectMeta{Name: "roundtrip", Namespace: ns},
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: ptr.To(kubevirtv1.RunStrategyHalted),
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: kubevirtv1.VirtualMachineInstanceSpec{
				Domain: kubevirtv1.DomainSpec{
					CPU:       &kubevirtv1.CPU{Cores: 2},
					Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("2Gi")}},
					Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{
						{Name: "hot", Serial: "abc", DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: "scsi"}}},
						{Name: "lun", DiskDevice: kubevirtv1.DiskDevice{LUN: &kubevirtv1.LunTarget{Bus: "scsi", Reservation: true}}},
					}},
				},
				Volumes:  []kubevirtv1.Volume{pvcVol("hot", "c1", true), pvcVol("lun", "c2", false)},
				Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{}},
			}},
		},
	}
	out := &kubevirtv1.VirtualMachine{}
	if err := proxyKV(t, s).create(ctx, resVMs, ns, in, out); err != nil {
		t.Fatal(err)
	}
	if !equality.Semantic.DeepEqual(in.Spec, out.Spec) {
		t.Errorf("spec did not round-trip:\n in %+v\nout %+v", in.Spec, out.Spec)
	}
}

func TestProvisioner(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{})
	ctx := testCtx(t, 30*time.Second)
	pvc, err := s.CreatePVC(ctx, ns, "data", "3Gi", false)
	if err != nil {
		t.Fatal(err)
	}
	if pvc.Spec.VolumeName == "" || pvc.Status.Capacity.Storage().String() != "3Gi" || len(pvc.Status.AccessModes) != 1 {
		t.Errorf("bound PVC %+v", pvc.Status)
	}
	pv, err := s.c.kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil || pv.Status.Phase != corev1.VolumeBound || pv.Spec.ClaimRef.UID != pvc.UID || pv.Spec.CSI.Driver != LonghornProvisioner {
		t.Errorf("PV %v %+v", err, pv)
	}
	// Other classes and class-less claims are left alone by default.
	for name, class := range map[string]*string{"other": ptr.To("local-path"), "none": nil} {
		p := &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				StorageClassName: class,
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			},
		}
		if _, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond)
	for _, name := range []string{"other", "none"} {
		if p, _ := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{}); p.Status.Phase == corev1.ClaimBound {
			t.Errorf("%s was bound", name)
		}
	}
	// Deleting the claim deletes its volume.
	if err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the claim's PV to be deleted", func() (bool, string) {
		_, err := s.c.kube.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
}

func TestBindClasslessPVCs(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{BindClasslessPVCs: true, Version: V1_5_3})
	ctx := testCtx(t, 30*time.Second)
	p := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "none", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the class-less PVC to be bound", func() (bool, string) {
		got, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "none", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return got.Status.Phase == corev1.ClaimBound && got.Spec.VolumeName != "", fmt.Sprintf("%s, volume %q", got.Status.Phase, got.Spec.VolumeName)
	})
}

// TestStartWithHotplugVolumes (behaviour 6): template hotplug volumes go
// through the attachment pod; the VMI stays Scheduled until they are mounted.
func TestStartWithHotplugVolumes(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative})
	ctx := testCtx(t, 60*time.Second)
	if _, err := s.CreatePVC(ctx, ns, "pvc-a", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var phases []string
	_, _ = s.c.vmiInf.AddEventHandler(cacheHandler(func(obj any) {
		vmi := obj.(*kubevirtv1.VirtualMachineInstance)
		if vmi.Namespace != ns {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		p := string(vmi.Status.Phase)
		if e, ok := FindVolumeStatus(vmi, "pvc-a"); ok {
			p += "/" + string(e.Phase)
		}
		if len(phases) == 0 || phases[len(phases)-1] != p {
			phases = append(phases, p)
		}
	}))
	_, err := s.CreateVM(ctx, VMSpec{
		Namespace: ns, Name: "vm1", NodeName: "node-7",
		Volumes: []kubevirtv1.Volume{pvcVol("pvc-a", "pvc-a", true)},
		Disks:   []kubevirtv1.Disk{{Name: "pvc-a", DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: "scsi"}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-a", 20*time.Second)
	want := []string{"", "Pending", "Scheduling", "Scheduled/AttachedToNode", "Running/MountedToPod", "Running/Ready"}
	testwait.Until(testCtx(t, 3*time.Second), t, fmt.Sprintf("the phases %v", want), func() (bool, string) {
		mu.Lock()
		got := slices.Clone(phases)
		mu.Unlock()
		return slices.Equal(got, want), fmt.Sprintf("phases %v", got)
	})
	_, vmi := s.VM(ns, "vm1")
	if vmi.Status.NodeName != "node-7" || len(vmi.Status.Interfaces) != 1 || vmi.Status.Interfaces[0].MAC == "" {
		t.Errorf("VMI status %+v", vmi.Status)
	}
	if e, _ := FindVolumeStatus(vmi, "rootdisk"); e.Target != "vda" || e.HotplugVolume != nil {
		t.Errorf("rootdisk entry %+v", e)
	}
	if pods := s.c.attachmentPods(vmi); len(pods) != 1 || pods[0].Spec.NodeName != "node-7" {
		t.Errorf("attachment pods %v", pods)
	}
}

// TestStopDeleteVM: stopping deletes the VMI after the shutdown delay; a
// deleted VM's VMI outlives it for that delay, then takes its attachment pods
// with it.
func TestStopDeleteVM(t *testing.T) {
	t.Parallel()
	hook := &hookLog{}
	s, ns := testSim(t, Options{Mode: ModeDeclarative, DiskHook: hook})
	hook.s = s
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a")
	if err := patchVMVolumes(ctx, t, s, proxyKV(t, s), ns, "vm1", []string{"pvc-a"}, nil); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-a", 20*time.Second)

	if err := s.StopVM(ctx, ns, "vm1"); err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi.DeletionTimestamp != nil })
	stopAt := time.Now()
	err := s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi == nil && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped
	})
	if err != nil {
		t.Fatal(err)
	}
	// The grace period (30 s, scaled to 1.5 s) is a lower bound however
	// busy the machine is.
	if d := time.Since(stopAt); d < time.Second {
		t.Errorf("VMI gone after %v, before its grace period", d)
	}
	if err := s.StartVM(ctx, ns, "vm1"); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-a", 20*time.Second)

	if err := s.DeleteVM(ctx, ns, "vm1"); err != nil {
		t.Fatal(err)
	}
	err = s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vm == nil && vmi != nil && vmi.DeletionTimestamp != nil
	})
	if err != nil {
		t.Fatalf("VMI should outlive its VM: %v", err)
	}
	if err := s.Wait(ctx, ns, "vm1", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi == nil }); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the attachment pods to go", func() (bool, string) {
		pods, err := s.c.kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		return len(pods.Items) == 0, fmt.Sprintf("%d attachment pods left", len(pods.Items))
	})
	want := []string{"plug " + ns + "/vm1 pvc-a pvc-a", "unplug " + ns + "/vm1 pvc-a", "plug " + ns + "/vm1 pvc-a pvc-a", "unplug " + ns + "/vm1 pvc-a"}
	if got := hook.get(); !slices.Equal(got, want) {
		t.Errorf("hook calls %q, want %q", got, want)
	}
}

// TestStuckAttachmentPod: a stuck pod keeps the volume AttachedToNode.
func TestStuckAttachmentPod(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeLegacy})
	ctx := testCtx(t, 60*time.Second)
	vmWithClaims(ctx, t, s, ns, "vm1", "pvc-a")
	s.Faults().SetAttachmentPodsStuck(ns, "vm1", true)
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-a"))
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		e, ok := FindVolumeStatus(vmi, "pvc-a")
		return ok && e.Phase == kubevirtv1.HotplugVolumeAttachedToNode
	})
	time.Sleep(3 * s.c.opts.Timings.PodStartFresh)
	_, vmi := s.VM(ns, "vm1")
	if e, _ := FindVolumeStatus(vmi, "pvc-a"); e.Phase != kubevirtv1.HotplugVolumeAttachedToNode || e.HotplugVolume.AttachPodUID != "" ||
		e.Reason != "SuccessfulCreate" || e.Message != "Created hotplug attachment pod "+e.HotplugVolume.AttachPodName+", for volume pvc-a" {
		t.Errorf("stuck entry %+v %+v", e, e.HotplugVolume)
	}
	s.Faults().SetAttachmentPodsStuck(ns, "vm1", false)
	ready(t, s, ns, "vm1", "pvc-a", 20*time.Second)
}

// TestPendingPVC: a missing claim keeps the entry Pending with the
// PVC-derived reason; once the claim exists, unbound, it goes into the
// attachment pod, which waits for the binding.
func TestPendingPVC(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative, Timings: Timings{Bind: 40 * time.Second}})
	ctx := testCtx(t, 60*time.Second)
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "vm1"}); err != nil {
		t.Fatal(err)
	}
	c := proxyKV(t, s)
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"missing"}, nil); err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		e, ok := FindVolumeStatus(vmi, "missing")
		return ok && e.Phase == kubevirtv1.VolumePending && e.Reason == "FailedPvcNotFound" && e.Message == "PVC missing not found"
	})
	if _, err := s.CreatePVC(ctx, ns, "missing", "1Gi", true); err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		e, ok := FindVolumeStatus(vmi, "missing")
		if !ok || e.Phase != kubevirtv1.HotplugVolumeAttachedToNode {
			return false
		}
		pvc := s.c.pvc(ns, "missing")
		pods := s.c.attachmentPods(vmi)
		return pvc != nil && pvc.Status.Phase == corev1.ClaimPending && len(pods) == 1 && pods[0].Status.Phase == corev1.PodPending
	})
	ready(t, s, ns, "vm1", "missing", 20*time.Second)
}

// TestProxyWatch: watches stream through the front proxy with the caller's
// credentials, and the proxy counts them.
func TestProxyWatch(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{})
	ctx := testCtx(t, 30*time.Second)
	c := proxyKV(t, s)
	inf := c.informer(resVMs, ns, &kubevirtv1.VirtualMachine{}, &kubevirtv1.VirtualMachineList{})
	seen := make(chan string, 10)
	_, _ = inf.AddEventHandler(cacheHandler(func(obj any) { seen <- obj.(*kubevirtv1.VirtualMachine).Name }))
	go inf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		t.Fatal("informer through the proxy did not sync")
	}
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "watched", NoWait: true}); err != nil {
		t.Fatal(err)
	}
	select {
	case name := <-seen:
		if name != "watched" {
			t.Errorf("saw %q", name)
		}
	case <-ctx.Done():
		t.Fatal("no watch event through the proxy")
	}
	st := s.Stats()
	if st.Requests[RequestKey{"watch", "kubevirt.io", resVMs, ""}] != 1 || st.Requests[RequestKey{"list", "kubevirt.io", resVMs, ""}] != 1 {
		t.Errorf("requests %v", st.Requests)
	}
	// Without credentials the API server answers, through the proxy, 403.
	anon, err := newKVClient(&rest.Config{Host: s.ProxyURL()})
	if err != nil {
		t.Fatal(err)
	}
	if err := anon.get(ctx, resVMs, ns, "watched", &kubevirtv1.VirtualMachine{}); !apierrors.IsForbidden(err) {
		t.Errorf("anonymous get: %v", err)
	}
}

// TestVMIStartPhases: virt-controller takes a new VMI through Pending (the
// pass that creates its virt-launcher pod) and Scheduling (the pod exists,
// not yet running) to Scheduled, each its own write (v1.7.0
// pkg/virt-controller/watch/vmi/lifecycle.go:280-288, 331-382), and
// virt-handler then to Running.
func TestVMIStartPhases(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative})
	ctx := testCtx(t, 30*time.Second)
	var mu sync.Mutex
	var phases []string
	_, _ = s.c.vmiInf.AddEventHandler(cacheHandler(func(obj any) {
		vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok || vmi.Namespace != ns || vmi.Name != "starting" {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if p := string(vmi.Status.Phase); len(phases) == 0 || phases[len(phases)-1] != p {
			phases = append(phases, p)
		}
	}))
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "starting"}); err != nil {
		t.Fatal(err)
	}
	want := []string{"", "Pending", "Scheduling", "Scheduled", "Running"}
	testwait.Until(ctx, t, "the VMI's phases", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return slices.Equal(phases, want), fmt.Sprint(phases)
	})
}
