package kubevirtsim

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// Harvester's settings API.
var settingsGVR = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"}

// serverVersionSetting is the name of Harvester's version setting.
const serverVersionSetting = "server-version"

// LonghornProvisioner is the provisioner name of the StorageClass Install
// creates when it is missing.
const LonghornProvisioner = "driver.longhorn.io"

func crdDef(group, version, plural, singular, kind string, namespaced bool, shortNames []string, schemaProps *apiextv1.JSONSchemaProps) *apiextv1.CustomResourceDefinition {
	scope := apiextv1.ClusterScoped
	if namespaced {
		scope = apiextv1.NamespaceScoped
	}
	if schemaProps == nil {
		schemaProps = &apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr.To(true)}
	}
	return &apiextv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: plural + "." + group},
		Spec: apiextv1.CustomResourceDefinitionSpec{
			Group: group,
			Names: apiextv1.CustomResourceDefinitionNames{
				Plural: plural, Singular: singular, Kind: kind, ListKind: kind + "List", ShortNames: shortNames,
			},
			Scope: scope,
			Versions: []apiextv1.CustomResourceDefinitionVersion{{
				Name: version, Served: true, Storage: true,
				Schema:       &apiextv1.CustomResourceValidation{OpenAPIV3Schema: schemaProps},
				Subresources: &apiextv1.CustomResourceSubresources{Status: &apiextv1.CustomResourceSubresourceStatus{}},
			}},
		},
	}
}

func crds() []*apiextv1.CustomResourceDefinition {
	preserve := func() apiextv1.JSONSchemaProps {
		return apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr.To(true)}
	}
	settingSchema := &apiextv1.JSONSchemaProps{
		Type:                   "object",
		XPreserveUnknownFields: ptr.To(true),
		Properties: map[string]apiextv1.JSONSchemaProps{
			"value":      {Type: "string"},
			"default":    {Type: "string"},
			"customized": {Type: "boolean"},
			"status":     preserve(),
		},
	}
	return append([]*apiextv1.CustomResourceDefinition{
		crdDef("kubevirt.io", "v1", "virtualmachines", "virtualmachine", "VirtualMachine", true, []string{"vm", "vms"},
			diskLimitSchema("spec", "template", "spec")),
		crdDef("kubevirt.io", "v1", "virtualmachineinstances", "virtualmachineinstance", "VirtualMachineInstance", true, []string{"vmi", "vmis"},
			diskLimitSchema("spec")),
		crdDef("kubevirt.io", "v1", "kubevirts", "kubevirt", "KubeVirt", true, []string{"kv", "kvs"}, nil),
		crdDef("kubevirt.io", "v1", "virtualmachineinstancemigrations", "virtualmachineinstancemigration", "VirtualMachineInstanceMigration", true, []string{"vmim", "vmims"}, nil),
		crdDef("harvesterhci.io", "v1beta1", "settings", "setting", "Setting", false, nil, settingSchema),
		// Stand-ins for external-snapshotter's CRDs (names, kinds, short
		// names, scopes and status subresources as there; open schemas).
		approved(crdDef(snapshotGroup, "v1", "volumesnapshots", "volumesnapshot", "VolumeSnapshot", true, []string{"vs"}, nil)),
		approved(crdDef(snapshotGroup, "v1", "volumesnapshotcontents", "volumesnapshotcontent", "VolumeSnapshotContent", false, []string{"vsc", "vscs"}, nil)),
		approved(withoutStatus(crdDef(snapshotGroup, "v1", "volumesnapshotclasses", "volumesnapshotclass", "VolumeSnapshotClass", false, []string{"vsclass", "vsclasses"}, nil))),
		networkFSCRD(),
	}, remoteBackupCRDs()...)
}

// MaxDisks is KubeVirt's limit on a VM's (and VMI's) disks and volumes:
// its CRDs' OpenAPI schemas give both lists maxItems 256 (kubevirt v1.7.0
// staging/src/kubevirt.io/api/core/v1/schema.go:464 for disks, types.go:128
// for volumes, generated into
// pkg/virt-operator/resource/generate/components/validations_generated.go),
// so the API server itself refuses a 257th, with its "Too many" message,
// whoever writes it: the driver, virt-api or virt-controller. That is
// KubeVirt's only answer: virt-api's VM and VMI admitters count no disks
// (kubevirt v1.5.3, v1.6.0, v1.7.0 and v1.8.2
// pkg/virt-api/webhooks/validating-webhook/admitters and
// pkg/storage/admitters check each disk, never their number), the API
// server validates against the schema before it calls validating webhooks,
// and virt-api's addvolume on a VMI writes the spec through the API server
// (v1.7.0 pkg/virt-api/rest/volumes.go:350 generateVolumeRequestPatch), so
// its 422 is that same refusal passed on.
const MaxDisks = 256

// diskLimitSchema is an open object schema whose VMI spec, at path, limits
// domain.devices.disks and volumes to MaxDisks items, as KubeVirt's CRDs do;
// everything else is kept unchecked.
func diskLimitSchema(path ...string) *apiextv1.JSONSchemaProps {
	open := func(props map[string]apiextv1.JSONSchemaProps) apiextv1.JSONSchemaProps {
		return apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr.To(true), Properties: props}
	}
	list := apiextv1.JSONSchemaProps{Type: "array", MaxItems: ptr.To[int64](MaxDisks), Items: &apiextv1.JSONSchemaPropsOrArray{
		Schema: &apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr.To(true)},
	}}
	node := open(map[string]apiextv1.JSONSchemaProps{
		"domain":  open(map[string]apiextv1.JSONSchemaProps{"devices": open(map[string]apiextv1.JSONSchemaProps{"disks": list})}),
		"volumes": list,
	})
	for i := len(path) - 1; i >= 0; i-- {
		node = open(map[string]apiextv1.JSONSchemaProps{path[i]: node})
	}
	return &node
}

// approved adds the annotation the API server requires of CRDs in the
// protected *.k8s.io groups, with the approval the real snapshot CRDs cite.
func approved(c *apiextv1.CustomResourceDefinition) *apiextv1.CustomResourceDefinition {
	c.Annotations = map[string]string{apiextv1.KubeAPIApprovedAnnotation: "https://github.com/kubernetes-csi/external-snapshotter/pull/814"}
	return c
}

// withoutStatus drops the status subresource (a VolumeSnapshotClass has no
// status).
func withoutStatus(c *apiextv1.CustomResourceDefinition) *apiextv1.CustomResourceDefinition {
	for i := range c.Spec.Versions {
		c.Spec.Versions[i].Subresources = nil
	}
	return c
}

// InstallSnapshotCRDs installs the snapshot.storage.k8s.io stand-in CRDs on
// another API server, such as a guest cluster's (RKE2 ships the real ones),
// and waits until they are served.
func InstallSnapshotCRDs(ctx context.Context, cfg *rest.Config) error {
	ext, err := apiextclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	var snap []*apiextv1.CustomResourceDefinition
	for _, c := range crds() {
		if c.Spec.Group == snapshotGroup {
			snap = append(snap, c)
		}
	}
	return testenv.InstallCRDs(ctx, ext, snap)
}

// install creates the CRDs (keeping existing ones) and waits until they are
// Established, then writes the KubeVirt CR with the feature gates of the
// mode (creating its namespace), the Harvester server-version setting
// (unless Options.SkipServerVersion) and the host StorageClass, the
// VolumeSnapshotClass SnapshotClass and the csi-driver-config setting if
// they are missing. It is idempotent and safe to run against a cluster
// another simulator already installed.
func (c *cluster) install(ctx context.Context) error {
	if err := testenv.InstallCRDs(ctx, c.ext, crds()); err != nil {
		return err
	}
	if err := c.ensureNamespace(ctx, c.opts.KubeVirtNamespace); err != nil {
		return err
	}
	if err := c.ensureNamespace(ctx, NetworkFSNamespace); err != nil {
		return err
	}
	if err := c.setFeatureGates(ctx, c.opts.gates()); err != nil {
		return err
	}
	if !c.opts.SkipServerVersion {
		if err := c.setServerVersion(ctx, c.opts.ServerVersion); err != nil {
			return err
		}
	}
	if err := c.ensureStorageClass(ctx); err != nil {
		return err
	}
	return c.ensureSnapshotConfig(ctx)
}

func (c *cluster) ensureNamespace(ctx context.Context, name string) error {
	_, err := c.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// The CRD may take a moment to serve after Established; retry NotFound.
func retryNotServed(ctx context.Context, f func() error) error {
	var err error
	for range 50 {
		if err = f(); err == nil || !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return err
}

// setFeatureGates replaces the feature gates of the KubeVirt CR (creating
// it if needed) and waits until the simulator's cache has them.
func (c *cluster) setFeatureGates(ctx context.Context, gates []string) error {
	ns, name := c.opts.KubeVirtNamespace, c.opts.KubeVirtName
	return retryNotServed(ctx, func() error {
		cur := &kubevirtv1.KubeVirt{}
		err := c.kv.get(ctx, resKubeVirts, ns, name, cur)
		if apierrors.IsNotFound(err) {
			kv := &kubevirtv1.KubeVirt{
				TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "KubeVirt"},
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
				Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
					DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{FeatureGates: gates},
				}},
			}
			created := &kubevirtv1.KubeVirt{}
			if err := c.kv.create(ctx, resKubeVirts, ns, kv, created); err != nil {
				return err
			}
			created.Status.Phase = kubevirtv1.KubeVirtPhaseDeployed
			created.Status.ObservedKubeVirtVersion = c.feat.observedVersion
			return c.kv.update(ctx, resKubeVirts, ns, name, "status", created, &kubevirtv1.KubeVirt{})
		}
		if err != nil {
			return err
		}
		if cur.Spec.Configuration.DeveloperConfiguration == nil {
			cur.Spec.Configuration.DeveloperConfiguration = &kubevirtv1.DeveloperConfiguration{}
		}
		cur.Spec.Configuration.DeveloperConfiguration.FeatureGates = gates
		updated := &kubevirtv1.KubeVirt{}
		if err := c.kv.update(ctx, resKubeVirts, ns, name, "", cur, updated); err != nil {
			return err
		}
		c.waitGates(ctx, gates)
		return nil
	})
}

// waitGates waits (briefly) until the informer has seen the gates.
func (c *cluster) waitGates(ctx context.Context, gates []string) {
	if c.kvInf == nil {
		return
	}
	_ = wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		obj, ok, _ := c.kvInf.GetStore().GetByKey(c.opts.KubeVirtNamespace + "/" + c.opts.KubeVirtName)
		if !ok {
			return false, nil
		}
		dc := obj.(*kubevirtv1.KubeVirt).Spec.Configuration.DeveloperConfiguration
		var have []string
		if dc != nil {
			have = dc.FeatureGates
		}
		if len(have) != len(gates) {
			return false, nil
		}
		for i := range have {
			if have[i] != gates[i] {
				return false, nil
			}
		}
		return true, nil
	})
}

// setServerVersion writes Harvester's server-version setting (value field).
func (c *cluster) setServerVersion(ctx context.Context, version string) error {
	res := c.dyn.Resource(settingsGVR)
	return retryNotServed(ctx, func() error {
		cur, err := res.Get(ctx, serverVersionSetting, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			obj := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "harvesterhci.io/v1beta1",
				"kind":       "Setting",
				"metadata":   map[string]any{"name": serverVersionSetting},
				"default":    "",
				"value":      version,
			}}
			_, err = res.Create(ctx, obj, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		cur.Object["value"] = version
		_, err = res.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
}

func (c *cluster) ensureStorageClass(ctx context.Context) error {
	if c.opts.StorageClass == "" {
		return nil
	}
	_, err := c.kube.StorageV1().StorageClasses().Get(ctx, c.opts.StorageClass, metav1.GetOptions{})
	if err == nil {
		return nil
	}
	if !apierrors.IsNotFound(err) {
		return err
	}
	sc := &storagev1.StorageClass{
		ObjectMeta:           metav1.ObjectMeta{Name: c.opts.StorageClass},
		Provisioner:          LonghornProvisioner,
		ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
		AllowVolumeExpansion: ptr.To(true),
		VolumeBindingMode:    ptr.To(storagev1.VolumeBindingImmediate),
		Parameters:           map[string]string{"numberOfReplicas": "3", "staleReplicaTimeout": "30"},
	}
	if _, err := c.kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}
