package host

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/streaming"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/diff"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	restclientwatch "k8s.io/client-go/rest/watch"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	kvscheme "kubevirt.io/client-go/kubevirt/scheme"
)

// fullSerializer is what the typed KubeVirt client decodes with.
func fullSerializer() runtime.NegotiatedSerializer {
	return rest.CodecFactoryForGeneratedClient(kvscheme.Scheme, kvscheme.Codecs).WithoutConversion()
}

// eventDecoder decodes a watch stream as client-go's watch request does,
// with the serializer's decoders.
func eventDecoder(t testing.TB, ns runtime.NegotiatedSerializer, stream io.Reader) *restclientwatch.Decoder {
	t.Helper()
	dec, ser, framer, err := runtime.NewClientNegotiator(ns, kubevirtv1.SchemeGroupVersion).StreamDecoder(runtime.ContentTypeJSON, nil)
	if err != nil {
		t.Fatal(err)
	}
	return restclientwatch.NewDecoder(streaming.NewDecoder(framer.NewFrameReader(io.NopCloser(stream)), ser), dec)
}

func decodeEvent(t testing.TB, ns runtime.NegotiatedSerializer, frame []byte) (watch.EventType, runtime.Object) {
	t.Helper()
	typ, obj, err := eventDecoder(t, ns, bytes.NewReader(frame)).Decode()
	if err != nil {
		t.Fatal(err)
	}
	return typ, obj
}

func watchFrame(t testing.TB, typ watch.EventType, obj any) []byte {
	t.Helper()
	raw, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	frame, err := json.Marshal(metav1.WatchEvent{Type: string(typ), Object: runtime.RawExtension{Raw: raw}})
	if err != nil {
		t.Fatal(err)
	}
	return append(frame, '\n')
}

var (
	created   = metav1.NewTime(time.Date(2026, 3, 2, 9, 14, 5, 0, time.UTC))
	migrated  = metav1.NewTime(time.Date(2026, 3, 2, 10, 1, 44, 0, time.UTC))
	migration = metav1.NewTime(time.Date(2026, 3, 2, 10, 2, 31, 0, time.UTC))
)

func hotplugName(i int) string { return fmt.Sprintf("pvc-3f9c1e52-7b1d-4c8e-9a%02d-%010d", i%100, i) }

func kvClaim(claim string, hot bool) *kubevirtv1.PersistentVolumeClaimVolumeSource {
	return &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim, ReadOnly: false}, Hotpluggable: hot}
}

// fixtureSpec is a Harvester VM's instance spec with hotplugs hot-plugged
// volumes of this driver after its root disk, a data volume and cloud-init.
func fixtureSpec(hotplugs int) kubevirtv1.VirtualMachineInstanceSpec {
	spec := kubevirtv1.VirtualMachineInstanceSpec{
		Domain: kubevirtv1.DomainSpec{
			Resources: kubevirtv1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("7908Mi")},
				Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourceMemory: resource.MustParse("8Gi")},
			},
			CPU:      &kubevirtv1.CPU{Cores: 4, Sockets: 1, Threads: 1},
			Memory:   &kubevirtv1.Memory{Guest: ptr.To(resource.MustParse("7908Mi"))},
			Machine:  &kubevirtv1.Machine{Type: "q35"},
			Firmware: &kubevirtv1.Firmware{UUID: "5d307ca9-b3ef-428c-8861-06e72d69f223"},
			Features: &kubevirtv1.Features{ACPI: kubevirtv1.FeatureState{Enabled: ptr.To(true)}},
			Devices: kubevirtv1.Devices{
				Disks: []kubevirtv1.Disk{
					{Name: "rootdisk", BootOrder: ptr.To[uint](1), DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}},
					{Name: "datadisk", DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}},
					{Name: "cloudinitdisk", DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}},
				},
				Interfaces: []kubevirtv1.Interface{{Name: "default", MacAddress: "52:54:00:3d:8a:11", Model: "virtio",
					InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}}},
			},
		},
		Hostname:                      "guest-worker-1",
		EvictionStrategy:              ptr.To(kubevirtv1.EvictionStrategyLiveMigrateIfPossible),
		TerminationGracePeriodSeconds: ptr.To[int64](120),
		Networks: []kubevirtv1.Network{{Name: "default",
			NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "default/vlan1"}}}},
		Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
				{Key: "network.harvesterhci.io/mgmt", Operator: corev1.NodeSelectorOpIn, Values: []string{"true"}}}}}}}},
		Volumes: []kubevirtv1.Volume{
			{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: kvClaim("guest-worker-1-rootdisk-hx7q2", false)}},
			{Name: "datadisk", VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: "guest-worker-1-data"}}},
			{Name: "cloudinitdisk", VolumeSource: kubevirtv1.VolumeSource{CloudInitNoCloud: &kubevirtv1.CloudInitNoCloudSource{
				UserDataSecretRef: &corev1.LocalObjectReference{Name: "guest-worker-1-cloudinit"}, NetworkDataSecretRef: &corev1.LocalObjectReference{Name: "guest-worker-1-cloudinit"}}}},
		},
	}
	for i := range hotplugs {
		name := hotplugName(i)
		spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, kubevirtv1.Disk{Name: name, Serial: name[:20],
			DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}})
		spec.Volumes = append(spec.Volumes, kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: kvClaim(name, true)}})
	}
	return spec
}

func fixtureMeta(name string) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name: name, Namespace: "guests", UID: "8a5b3c1e-0f4d-4e55-b0a7-2c9d1e6f7a18", ResourceVersion: "48213377", Generation: 23,
		CreationTimestamp: created,
		Labels: map[string]string{"harvesterhci.io/vmName": "guest-worker-1", "kubevirt.io/nodeName": "harvester-node-2",
			"harvesterhci.io/creator": "terraform-provider-harvester"},
		Annotations: map[string]string{"harvesterhci.io/sshNames": `["guests/ops"]`, "kubevirt.io/latest-observed-api-version": "v1",
			"kubevirt.io/storage-observed-api-version": "v1"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachine", Name: "guest-worker-1",
			UID: "0b6a0f1e-6c55-4f0e-9a55-8f3e1b2d4c6a", Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}},
		Finalizers: []string{"kubevirt.io/virtualMachineControllerFinalize", "foregroundDeleteVirtualMachine"},
		ManagedFields: []metav1.ManagedFieldsEntry{
			{Manager: "virt-controller", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "kubevirt.io/v1", Time: &migration,
				FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:status":{"f:volumeStatus":{},"f:phase":{},"f:conditions":{}}}`)}},
			{Manager: "virt-handler", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "kubevirt.io/v1", Time: &migration,
				FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:status":{"f:interfaces":{},"f:guestOSInfo":{}}}`)}},
		},
	}
}

// fixtureVMI is a running Harvester VMI after a live migration, with
// hotplugs volumes of this driver: the last one still attaching.
func fixtureVMI(hotplugs int) *kubevirtv1.VirtualMachineInstance {
	vmi := &kubevirtv1.VirtualMachineInstance{
		TypeMeta:   metav1.TypeMeta{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachineInstance"},
		ObjectMeta: fixtureMeta("guest-worker-1"),
		Spec:       fixtureSpec(hotplugs),
		Status: kubevirtv1.VirtualMachineInstanceStatus{
			NodeName: "harvester-node-2",
			Phase:    kubevirtv1.Running,
			Conditions: []kubevirtv1.VirtualMachineInstanceCondition{
				{Type: kubevirtv1.VirtualMachineInstanceReady, Status: corev1.ConditionTrue, LastTransitionTime: migration},
				{Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionFalse, Reason: "DisksNotLiveMigratable",
					Message: "cannot migrate VMI: PVC guest-worker-1-data is not shared, live migration requires that all PVCs must be shared"},
				{Type: kubevirtv1.VirtualMachineInstanceAgentConnected, Status: corev1.ConditionTrue, LastProbeTime: migration},
			},
			PhaseTransitionTimestamps: []kubevirtv1.VirtualMachineInstancePhaseTransitionTimestamp{
				{Phase: kubevirtv1.Scheduled, PhaseTransitionTimestamp: created}, {Phase: kubevirtv1.Running, PhaseTransitionTimestamp: created}},
			Interfaces: []kubevirtv1.VirtualMachineInstanceNetworkInterface{{Name: "default", IP: "10.52.3.17", IPs: []string{"10.52.3.17"},
				MAC: "52:54:00:3d:8a:11", InterfaceName: "enp1s0", InfoSource: "domain, guest-agent"}},
			GuestOSInfo: kubevirtv1.VirtualMachineInstanceGuestOSInfo{Name: "openSUSE Leap Micro", ID: "opensuse-leap-micro",
				KernelRelease: "6.4.0-150600.23.38-default", Version: "6.0"},
			MigrationState: &kubevirtv1.VirtualMachineInstanceMigrationState{
				StartTimestamp: &migrated, EndTimestamp: &migration, SourceNode: "harvester-node-1", TargetNode: "harvester-node-2",
				TargetPod: "virt-launcher-guest-worker-1-x7wq9", MigrationUID: "6f1f4c0e-2b7a-4d3e-8a55-0c1d2e3f4a5b", Completed: true,
				Mode: kubevirtv1.MigrationPreCopy, TargetNodeAddress: "10.52.3.2"},
			MigrationMethod:               kubevirtv1.LiveMigration,
			QOSClass:                      ptr.To(corev1.PodQOSBurstable),
			LauncherContainerImageVersion: "registry.suse.com/suse/sles/15.6/virt-launcher:1.7.0-150600.5.9.1",
			ActivePods:                    map[types.UID]string{"b9c2d0f4-5e6a-4b7c-8d9e-0f1a2b3c4d5e": "harvester-node-2"},
			SelinuxContext:                "none",
			Machine:                       &kubevirtv1.Machine{Type: "pc-q35-8.2"},
			CurrentCPUTopology:            &kubevirtv1.CPUTopology{Cores: 4, Sockets: 1, Threads: 1},
			Memory: &kubevirtv1.MemoryStatus{GuestAtBoot: ptr.To(resource.MustParse("7908Mi")),
				GuestCurrent: ptr.To(resource.MustParse("7908Mi")), GuestRequested: ptr.To(resource.MustParse("7908Mi"))},
			VolumeStatus: []kubevirtv1.VolumeStatus{
				{Name: "cloudinitdisk", Target: "vdc", Phase: kubevirtv1.VolumeReady, Size: 1048576},
				{Name: "datadisk", Target: "vdb", Phase: kubevirtv1.VolumeReady,
					PersistentVolumeClaimInfo: claimInfo("guest-worker-1-data", "100Gi")},
				{Name: "rootdisk", Target: "vda", Phase: kubevirtv1.VolumeReady,
					PersistentVolumeClaimInfo: claimInfo("guest-worker-1-rootdisk-hx7q2", "40Gi")},
			},
		},
	}
	for i := range hotplugs {
		name := hotplugName(i)
		st := kubevirtv1.VolumeStatus{Name: name, Target: fmt.Sprintf("sd%c%c", 'a'+i/26, 'a'+i%26), Phase: kubevirtv1.VolumeReady,
			Reason: "VolumeReady", Message: "Successfully attach hotplugged volume " + name + " to VM",
			HotplugVolume:             &kubevirtv1.HotplugVolumeStatus{AttachPodName: "hp-volume-k2x8w", AttachPodUID: "e3d2c1b0-a9f8-4e7d-b6c5-d4e3f2a1b0c9"},
			PersistentVolumeClaimInfo: claimInfo(name, "10Gi")}
		if i == hotplugs-1 {
			st.Target, st.Phase, st.Reason, st.Message = "", kubevirtv1.HotplugVolumeAttachedToNode, "SuccessfulCreate",
				"Created hotplug attachment pod hp-volume-q9z4t, for volume "+name
			st.HotplugVolume = &kubevirtv1.HotplugVolumeStatus{AttachPodName: "hp-volume-q9z4t"}
		}
		vmi.Status.VolumeStatus = append(vmi.Status.VolumeStatus, st)
	}
	return vmi
}

// deleting is a VMI the VM's stop is deleting.
func deleting(vmi *kubevirtv1.VirtualMachineInstance) *kubevirtv1.VirtualMachineInstance {
	vmi.DeletionTimestamp, vmi.DeletionGracePeriodSeconds = &migration, ptr.To[int64](120)
	vmi.Status.Phase = kubevirtv1.Succeeded
	return vmi
}

func claimInfo(claim, size string) *kubevirtv1.PersistentVolumeClaimInfo {
	return &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: claim,
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}, VolumeMode: ptr.To(corev1.PersistentVolumeBlock),
		Capacity:           corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)},
		Requests:           corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)},
		FilesystemOverhead: ptr.To(kubevirtv1.Percent("0.055"))}
}

// fixtureVM is the VM of fixtureVMI, with a legacy add and remove queued
// and a webhook's refusal in its Failure condition.
func fixtureVM(hotplugs int) *kubevirtv1.VirtualMachine {
	meta := fixtureMeta("guest-worker-1")
	meta.OwnerReferences = nil
	meta.Annotations[lastApplied] = `{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine","metadata":{"name":"guest-worker-1"}}`
	queued := hotplugName(hotplugs)
	return &kubevirtv1.VirtualMachine{
		TypeMeta:   metav1.TypeMeta{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachine"},
		ObjectMeta: meta,
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: ptr.To(kubevirtv1.RunStrategyRerunOnFailure),
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"harvesterhci.io/vmName": "guest-worker-1"},
					Annotations: map[string]string{"harvesterhci.io/sshNames": `["guests/ops"]`}},
				Spec: fixtureSpec(hotplugs),
			},
		},
		Status: kubevirtv1.VirtualMachineStatus{
			Created: true, Ready: true, PrintableStatus: kubevirtv1.VirtualMachineStatusRunning,
			ObservedGeneration: 23, DesiredGeneration: 23, RunStrategy: kubevirtv1.RunStrategyRerunOnFailure,
			Conditions: []kubevirtv1.VirtualMachineCondition{
				{Type: kubevirtv1.VirtualMachineReady, Status: corev1.ConditionTrue, LastTransitionTime: migration},
				{Type: kubevirtv1.VirtualMachineFailure, Status: corev1.ConditionTrue, Reason: "FailedUpdateError", LastProbeTime: migration,
					Message: `admission webhook "validator.harvesterhci.io" denied the request: the volume ` + queued + ` is already used by VM guests/guest-worker-2`},
			},
			VolumeRequests: []kubevirtv1.VirtualMachineVolumeRequest{
				{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: queued, DryRun: []string{},
					Disk:         &kubevirtv1.Disk{Name: queued, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}},
					VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: kvClaim(queued, true)}}},
				{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: hotplugName(0)}},
			},
			VolumeSnapshotStatuses: []kubevirtv1.VolumeSnapshotStatus{{Name: "rootdisk", Enabled: true},
				{Name: "cloudinitdisk", Reason: "Snapshot is not supported for this volumeSource type [cloudinitdisk]"}},
		},
	}
}

// jsonDiff shows where two objects' JSON parts.
func jsonDiff(t *testing.T, a, b any) string {
	t.Helper()
	ja, errA := json.MarshalIndent(a, "", " ")
	jb, errB := json.MarshalIndent(b, "", " ")
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	return diff.StringDiff(string(ja), string(jb))
}

// prune keeps of a decoded kubevirtv1 object the fields the lean types keep.
func prune(v reflect.Value, kept map[string]bool) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			prune(v.Elem(), kept)
		}
	case reflect.Slice:
		for i := range v.Len() {
			prune(v.Index(i), kept)
		}
	case reflect.Struct:
		t := v.Type()
		for i := range t.NumField() {
			if !t.Field(i).IsExported() {
				continue
			}
			switch whole, ok := kept[fieldKey(t, t.Field(i).Name)]; {
			case !ok:
				v.Field(i).Set(reflect.Zero(t.Field(i).Type))
			case !whole:
				prune(v.Field(i), kept)
			}
		}
	}
}

// filled marks the kept fields that hold a value somewhere in v.
func filled(v reflect.Value, kept, seen map[string]bool) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			filled(v.Elem(), kept, seen)
		}
	case reflect.Slice:
		for i := range v.Len() {
			filled(v.Index(i), kept, seen)
		}
	case reflect.Struct:
		t := v.Type()
		for i := range t.NumField() {
			key := fieldKey(t, t.Field(i).Name)
			whole, ok := kept[key]
			if !ok || v.Field(i).IsZero() {
				continue
			}
			seen[key] = true
			if !whole {
				filled(v.Field(i), kept, seen)
			}
		}
	}
}

// The lean decoding of a watch event holds the same values as the full
// decoding the typed client makes, in every field the lean types keep, and
// nothing else: managedFields and kubectl's last-applied copy are gone.
func TestLeanDecodeMatchesFullDecode(t *testing.T) {
	kept := keptFields(t)
	seen := map[string]bool{}
	for _, c := range []struct {
		name string
		obj  runtime.Object
		lean leanResource
	}{
		{"VMI", fixtureVMI(3), leanVMIs()},
		{"VMI being deleted", deleting(fixtureVMI(1)), leanVMIs()},
		{"VM", fixtureVM(3), leanVMs()},
	} {
		t.Run(c.name, func(t *testing.T) {
			frame := watchFrame(t, watch.Modified, c.obj)
			_, full := decodeEvent(t, fullSerializer(), frame)
			typ, lean := decodeEvent(t, leanCodec{res: c.lean}, frame)
			if typ != watch.Modified {
				t.Errorf("event type %s, want %s", typ, watch.Modified)
			}
			filled(reflect.ValueOf(full), kept, seen)
			want := full.DeepCopyObject()
			prune(reflect.ValueOf(want), kept)
			delete(want.(metav1.Object).GetAnnotations(), lastApplied)
			if !equality.Semantic.DeepEqual(lean, want) {
				t.Errorf("lean decode differs from the full one's kept fields (- lean, + full):\n%s", jsonDiff(t, lean, want))
			}
			m := lean.(metav1.Object)
			if len(m.GetManagedFields()) != 0 || m.GetAnnotations()[lastApplied] != "" || len(m.GetAnnotations()) != 3 {
				t.Errorf("lean metadata: managedFields %v, annotations %v; want none, and all but kubectl's", m.GetManagedFields(), m.GetAnnotations())
			}
		})
	}
	// Every kept field has a value in the fixtures: a field filled wrongly
	// or not at all cannot hide behind an empty one.
	for _, k := range slices.Sorted(mapsKeys(kept)) {
		if !seen[k] {
			t.Errorf("the fixtures leave %s empty", k)
		}
	}
}

// A list decodes as its watch events do, with its list metadata (the
// reflector pages with the continue token and starts watching from the
// resourceVersion).
func TestLeanListDecode(t *testing.T) {
	full := &kubevirtv1.VirtualMachineInstanceList{
		ListMeta: metav1.ListMeta{ResourceVersion: "48213390", Continue: "eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ", RemainingItemCount: ptr.To[int64](7)},
		Items:    []kubevirtv1.VirtualMachineInstance{*fixtureVMI(2), *fixtureVMI(0)},
	}
	full.Items[1].Name = "guest-worker-2"
	raw, err := json.Marshal(full)
	if err != nil {
		t.Fatal(err)
	}
	var got kubevirtv1.VirtualMachineInstanceList
	out, _, err := leanCodec{res: leanVMIs()}.Decode(raw, nil, &got)
	if err != nil || out != &got {
		t.Fatalf("decode: %v, %T", err, out)
	}
	if !equality.Semantic.DeepEqual(got.ListMeta, full.ListMeta) || len(got.Items) != 2 {
		t.Fatalf("list metadata %+v with %d items, want %+v with 2", got.ListMeta, len(got.Items), full.ListMeta)
	}
	kept := keptFields(t)
	for i := range full.Items {
		want := full.Items[i].DeepCopy()
		prune(reflect.ValueOf(want), kept)
		if !equality.Semantic.DeepEqual(&got.Items[i], want) {
			t.Errorf("item %d differs (- lean, + full):\n%s", i, jsonDiff(t, &got.Items[i], want))
		}
	}
	if _, _, err := (leanCodec{res: leanVMs()}).Decode(raw, nil, &got); err == nil {
		t.Error("the VM decoder decoded into a VMI list")
	}
}

// The API server's Status answers keep their meaning: a watch's ERROR event
// (the reflector lists again on an expired resourceVersion) and an error
// body; a bookmark keeps what ends a watch list's initial events.
func TestLeanDecodeStatusAndBookmark(t *testing.T) {
	codec := leanCodec{res: leanVMIs()}
	gone := &metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}, Status: metav1.StatusFailure,
		Message: "too old resource version: 48213377 (48219001)", Reason: metav1.StatusReasonExpired, Code: 410}
	typ, obj := decodeEvent(t, codec, watchFrame(t, watch.Error, gone))
	if st, ok := obj.(*metav1.Status); typ != watch.Error || !ok || !apierrors.IsResourceExpired(apierrors.FromObject(st)) {
		t.Errorf("ERROR event: %s %#v, want an expired Status", typ, obj)
	}
	raw, _ := json.Marshal(gone)
	var list kubevirtv1.VirtualMachineInstanceList
	if out, _, err := codec.Decode(raw, nil, &list); err != nil || !apierrors.IsResourceExpired(apierrors.FromObject(out)) {
		t.Errorf("a Status body for a list: %v, %#v", err, out)
	}
	bookmark := &kubevirtv1.VirtualMachineInstance{TypeMeta: metav1.TypeMeta{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachineInstance"},
		ObjectMeta: metav1.ObjectMeta{ResourceVersion: "48219002", Annotations: map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}
	typ, obj = decodeEvent(t, codec, watchFrame(t, watch.Bookmark, bookmark))
	if m, ok := obj.(*kubevirtv1.VirtualMachineInstance); typ != watch.Bookmark || !ok || m.ResourceVersion != "48219002" ||
		m.Annotations[metav1.InitialEventsAnnotationKey] != "true" {
		t.Errorf("BOOKMARK event: %s %#v", typ, obj)
	}
	if _, _, err := codec.Decode([]byte(`{"kind":"VirtualMachineInstance","status":{"phase":7}}`), nil, nil); err == nil {
		t.Error("a VMI whose phase is not a string decoded")
	}
}

// BenchmarkDecodeVMIWatchEvent decodes the watch event of a VMI holding 200
// hot-plugged volumes from a stream, as the informer's watch does, with the
// typed client's decoder and with the lean one.
func BenchmarkDecodeVMIWatchEvent(b *testing.B) {
	frame := watchFrame(b, watch.Modified, fixtureVMI(200))
	for _, c := range []struct {
		name string
		ns   runtime.NegotiatedSerializer
	}{{"full", fullSerializer()}, {"lean", leanCodec{res: leanVMIs()}}} {
		b.Run(c.name, func(b *testing.B) {
			dec := eventDecoder(b, c.ns, bytes.NewReader(bytes.Repeat(frame, b.N)))
			b.SetBytes(int64(len(frame)))
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, _, err := dec.Decode(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
